"""The deployment config and CLI, without starting Ray: serve_config.yaml must be valid for Ray Serve 2.60's
own schema, and its args (and the CLI's) must be what serve.app.build_app accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from serve.__main__ import app_args, parse_args
from serve.app import AppArgs

REPO = Path(__file__).resolve().parents[1]


def test_serve_config_validates_against_ray_serve_schema() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text()))
    (app,) = config.applications
    assert app.import_path == "serve.app:build_app" and app.route_prefix == "/"
    AppArgs.model_validate(app.args)
    (deployment,) = app.deployments
    assert deployment.name == "CompletionServer"
    assert deployment.max_ongoing_requests == 32
    assert deployment.autoscaling_config["target_ongoing_requests"] == 8


def test_cli_args_become_valid_app_args(tmp_path: Path) -> None:
    args = parse_args(["--model", "m", "--canary-evalset", "e.jsonl", "--canary-interval", "30", "--port", "9000"])
    built = AppArgs.model_validate(app_args(args))
    assert built.canary_endpoint == "http://127.0.0.1:9000" and built.canary_interval == 30
    assert built.autoscaling_config is not None and built.num_replicas is None
    fixed = AppArgs.model_validate(app_args(parse_args(["--model", "m", "--num-replicas", "2"])))
    assert fixed.num_replicas == 2 and fixed.autoscaling_config is None


def test_cli_refuses_a_directory_that_is_not_an_export(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serve", "--model", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 2 and "not an export dir" in out.stderr
    helped = subprocess.run([sys.executable, "-m", "serve.canary", "--help"], capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0 and "--evalset" in helped.stdout
