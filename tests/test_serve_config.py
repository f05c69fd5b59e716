"""The deployment config and CLI, without starting Ray: serve_config.yaml must be valid for Ray Serve 2.60's
own schema, its args (and the CLI's) must be what serve.app.build_app accepts, and the values it states
must be serve.config's defaults (declared there once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from ground.overrides import ConfigError
from serve import config as serve_defaults
from serve.__main__ import app_args, parse_args
from serve.config import AppArgs
from serve.controller_env import controller_env

REPO = Path(__file__).resolve().parents[1]


def test_serve_config_validates_against_ray_serve_schema() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text()))
    (app,) = config.applications
    assert app.import_path == "serve.app:build_app" and app.route_prefix == "/"
    args = AppArgs.model_validate(app.args)
    # The engine deployment is named after the model, so its options are build_app arguments, not `deployments:`.
    assert not app.deployments
    # Defaults are serve/config.py's, not restated here: the YAML leaves them out (AppArgs' values apply) except the
    # autoscaling block, which must be the same.
    assert not {"max_batch_size", "max_ongoing_requests", "metrics_sd_dir", "canary_interval"} & set(app.args)
    assert args.autoscaling_config == serve_defaults.DEFAULT_AUTOSCALING
    # serve deploy starts the controller with what python -m serve gives it: the proxy guard and the busy-node timeouts.
    assert config.controller_options is not None
    assert config.controller_options.runtime_env["env_vars"] == controller_env()


def test_cli_args_become_valid_app_args(tmp_path: Path) -> None:
    args = parse_args(["--model", "m", "--canary-evalset", "e.jsonl", "--canary-interval", "30", "--port", "9000"])
    built = AppArgs.model_validate(app_args(args))
    assert built.canary_endpoint == "http://127.0.0.1:9000" and built.canary_interval == 30
    assert built.autoscaling_config is not None and built.num_replicas is None
    fixed = AppArgs.model_validate(app_args(parse_args(["--model", "m", "--num-replicas", "2"])))
    assert fixed.num_replicas == 2 and fixed.autoscaling_config is None
    defaults = AppArgs.model_validate(app_args(parse_args(["--model", "m"])))
    assert defaults.max_batch_size == serve_defaults.DEFAULT_MAX_BATCH_SIZE
    assert defaults.max_ongoing_requests == serve_defaults.DEFAULT_MAX_ONGOING_REQUESTS
    assert defaults.metrics_sd_dir == str(serve_defaults.DEFAULT_SD_DIR)


def test_cli_set_overrides_any_app_arg_and_is_validated() -> None:
    args = parse_args(["--model", "m", "--set", "autoscaling_config.max_replicas=4", "--set", "max_batch_size=16"])
    built = AppArgs.model_validate(app_args(args))
    assert built.autoscaling_config["max_replicas"] == 4 and built.autoscaling_config["min_replicas"] == 1
    assert built.max_batch_size == 16
    with pytest.raises(ConfigError, match="max_batch_sise: unknown key"):
        app_args(parse_args(["--model", "m", "--set", "max_batch_sise=16"]))
    with pytest.raises(ConfigError, match=r"max_batch_size: .*integer.*'many'"):
        app_args(parse_args(["--model", "m", "--set", "max_batch_size=many"]))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        app_args(parse_args(["--model", "m", "--set", "max_batch_size"]))


def test_request_caps_and_chat_template_flags_default_to_serve_config() -> None:
    defaults = AppArgs.model_validate(app_args(parse_args(["--model", "m"])))
    assert defaults.max_request_bytes == serve_defaults.DEFAULT_MAX_REQUEST_BYTES
    assert defaults.max_prompt_chars == serve_defaults.DEFAULT_MAX_PROMPT_CHARS
    assert defaults.max_choices == serve_defaults.DEFAULT_MAX_CHOICES
    assert defaults.chat_message_template == serve_defaults.DEFAULT_CHAT_MESSAGE_TEMPLATE
    assert defaults.chat_stop == serve_defaults.DEFAULT_CHAT_STOP
    flags = ["--model", "m", "--max-prompt-chars", "10", "--chat-message-template", "<{role}>{content}</{role}>"]
    built = AppArgs.model_validate(app_args(parse_args([*flags, "--chat-stop", "</", "--chat-stop", "\n\n"])))
    assert built.max_prompt_chars == 10 and built.chat_stop == ("</", "\n\n")
    # A template naming anything but {role} and {content} fails when the app is built, not on the first request.
    with pytest.raises(ConfigError, match="chat_message_template"):
        app_args(parse_args(["--model", "m", "--chat-message-template", "{speaker}: {content}"]))
    with pytest.raises(ConfigError, match="chat_message_template"):
        app_args(parse_args(["--model", "m", "--set", "chat_message_template={role}"]))


def test_engine_arguments_raylm_sets_are_refused_naming_the_field() -> None:
    for key, field in (("max_num_seqs", "max_batch_size"), ("chat_template", "chat_message_template")):
        with pytest.raises(ConfigError, match=f"{key} is set by raylm from {field}"):
            app_args(parse_args(["--model", "m", "--set", f"engine_kwargs.{key}=4"]))
    lineage_named = "fingerprint_value is set by raylm: a response's system_fingerprint is the export's lineage id"
    with pytest.raises(ConfigError, match=lineage_named):
        app_args(parse_args(["--model", "m", "--set", "engine_kwargs.fingerprint_value=x"]))
    eager = AppArgs.model_validate(app_args(parse_args(["--model", "m", "--enforce-eager"])))
    assert eager.engine_kwargs == {"enforce_eager": True}


def test_the_chat_template_renders_the_message_template_for_vllm() -> None:
    """The Jinja template vLLM gets renders exactly what str.format of the operator's template gives, literal
    braces, quotes and Jinja-looking text included (rendered here with jinja2, the engine vLLM uses)."""
    import jinja2

    template = 'says "{role}" {{%raw%}}: {content}\n'
    messages = [{"role": "user", "content": "hi {{ there }}"}, {"role": "assistant", "content": "ok"}]
    jinja = jinja2.Environment().from_string(serve_defaults.chat_template_jinja(template, "assistant:"))
    rendered = jinja.render(messages=messages, bos_token="<|endoftext|>", add_generation_prompt=True)
    expected = "".join(template.format(**m) for m in messages)
    assert rendered == "<|endoftext|>" + expected + "assistant:"
    with pytest.raises(ValueError, match="no format spec"):
        serve_defaults.chat_template_jinja("{role!r}: {content}", "")


def test_api_key_files_are_read_as_digests_and_bad_ones_refused(tmp_path: Path) -> None:
    from serve.api_key_file import ApiKeyError, key_digest, read_key_digests

    keys = tmp_path / "keys.txt"
    keys.write_text("# ops\nsk-one\n\n  sk-two  \n")
    assert set(read_key_digests(keys)) == {key_digest("sk-one"), key_digest("sk-two")}
    (tmp_path / "empty.txt").write_text("# none yet\n")
    with pytest.raises(ApiKeyError, match=r"empty\.txt holds no key"):
        read_key_digests(tmp_path / "empty.txt")
    with pytest.raises(ApiKeyError, match=r"cannot read the API key file .*missing\.txt"):
        read_key_digests(tmp_path / "missing.txt")


@pytest.mark.slow
def test_cli_refuses_a_directory_that_is_not_an_export(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serve", "--model", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 2
    # Refused before vLLM is imported (seconds rather than tens of them): nothing else on stderr, not even the notes
    # vLLM's import logs on a node without a GPU.
    refusal = f"error: {tmp_path} is not an export dir (python -m train.export): missing lineage.json, which the"
    assert out.stderr.strip().splitlines() == [f"{refusal} export writes last"], out.stderr
    helped = subprocess.run([sys.executable, "-m", "serve.canary", "--help"], capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0 and "--evalset" in helped.stdout


@pytest.mark.slow
def test_cli_refuses_an_api_key_file_it_cannot_read_naming_it(
    tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from serve.__main__ import main

    missing = tmp_path / "keys.txt"
    assert main(["--model", str(tiny_export), "--api-key-file", str(missing)]) == 2  # before Ray or an engine starts
    err = capsys.readouterr().err
    assert "cannot read the API key file" in err and str(missing) in err, err


def test_the_engine_config_carries_what_the_app_args_ask_for() -> None:
    """build_app's LLMConfig: raylm's settings mapped onto vLLM's and Ray Serve LLM's (no engine is started)."""
    from serve.app import llm_config
    from serve.engine import ModelDirOnTheNode
    from serve.model_dir import ExportInfo

    export = ExportInfo("s3://b/models/m", "m", {"train_config": {"model": {"block_size": 128}}}, "0123456789ab", 0)
    cpu = llm_config(
        AppArgs(model="m", max_batch_size=6, replica_cpus=2, cpu_kv_cache_gib=3, stream_batching_interval_ms=10,
                engine_env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}, engine_kwargs={"enforce_eager": True}),
        export,
    )  # fmt: skip
    assert cpu.model_id == "m" and cpu.model_loading_config.model_source == "s3://b/models/m"
    assert cpu.engine_kwargs["max_num_seqs"] == 6 and cpu.engine_kwargs["enforce_eager"] is True
    assert cpu.engine_kwargs["dtype"] == "float32"  # the export's precision unless engine_kwargs says otherwise
    assert "{{ bos_token }}" in cpu.engine_kwargs["chat_template"]
    assert cpu.placement_group_config["bundles"] == [{"CPU": 2.0}]
    assert cpu.runtime_env["env_vars"] == {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_KVCACHE_SPACE": "3"}
    # Unless asked, the batch is vLLM's own default for the device, not a number of raylm's.
    assert "max_num_seqs" not in llm_config(AppArgs(model="m"), export).engine_kwargs
    assert cpu.experimental_configs == {"stream_batching_interval_ms": 10.0}
    assert cpu.deployment_config["autoscaling_config"] == serve_defaults.DEFAULT_AUTOSCALING
    gpu = llm_config(AppArgs(model="m", replica_gpus=2, num_replicas=3, engine_kwargs={"dtype": "bfloat16"}), export)
    assert gpu.engine_kwargs["tensor_parallel_size"] == 2 and gpu.engine_kwargs["dtype"] == "bfloat16"
    assert gpu.placement_group_config["bundles"] == [{"CPU": 1.0, "GPU": 1}, {"GPU": 1}]
    # A replica on one node: its model directory is made there, so Ray Serve LLM's per-node download step is skipped.
    assert gpu.placement_group_config["strategy"] == cpu.placement_group_config["strategy"] == "STRICT_PACK"
    assert gpu.callback_config.callback_class is ModelDirOnTheNode
    assert gpu.deployment_config["num_replicas"] == 3 and "autoscaling_config" not in gpu.deployment_config
