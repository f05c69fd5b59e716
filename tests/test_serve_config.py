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

REPO = Path(__file__).resolve().parents[1]


def test_serve_config_validates_against_ray_serve_schema() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text()))
    (app,) = config.applications
    assert app.import_path == "serve.app:build_app" and app.route_prefix == "/"
    AppArgs.model_validate(app.args)
    (deployment,) = app.deployments
    assert deployment.name == "CompletionServer"
    # Defaults are serve/config.py's, not restated here: the YAML leaves them out (the deployment
    # decorator's and AppArgs' values apply) except the autoscaling block, which must be the same.
    assert "max_ongoing_requests" not in deployment.model_fields_set
    assert not {"max_batch_size", "metrics_sd_dir", "canary_interval"} & set(app.args)
    assert deployment.autoscaling_config == serve_defaults.DEFAULT_AUTOSCALING


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


def test_cli_refuses_a_directory_that_is_not_an_export(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serve", "--model", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 2 and "not an export dir" in out.stderr
    helped = subprocess.run([sys.executable, "-m", "serve.canary", "--help"], capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0 and "--evalset" in helped.stdout
