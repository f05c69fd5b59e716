"""ray_cluster.yaml against Ray's own autoscaler schema, and the `ray job submit` snippets in cluster/jobs/.

Validation uses the installed Ray: ray/autoscaler/ray-schema.json through jsonschema (what `ray up` checks),
then prepare_config (merges the AWS defaults as `ray up` does) and validate_config (head type, worker
bounds). The snippets are checked for shell syntax, for using only flags `ray job submit --help` lists,
for running the docs/formats.md commands, and their runtime env is packaged with Ray's own packaging code to
prove the excludes keep the upload small.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "ray_cluster.yaml"
JOBS = ROOT / "cluster" / "jobs"
SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_matches_ray_schema(config: dict) -> None:
    jsonschema.validate(config, json.loads(SCHEMA.read_text()))


def test_cluster_yaml_passes_ray_up_preparation(config: dict) -> None:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"
    # Every setup command runs on both node kinds after merging.
    assert prepared["worker_setup_commands"][: len(config["setup_commands"])] == config["setup_commands"]


def test_schema_validation_would_catch_mistakes(config: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_worker"]["resources"] = {"GPU": 0.5}  # resources must be integers
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    typo = {**copy.deepcopy(config), "setup_comands": []}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)


def test_cluster_shape(config: dict) -> None:
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0}
    gpu = types["gpu_worker"]
    assert gpu["node_config"]["InstanceType"].startswith(("g5.", "g6.", "p4d.", "p4de.", "p5"))
    assert gpu["resources"]["GPU"] >= 1
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]
    assert sum(t.get("max_workers", 0) for t in types.values()) >= 1
    for node_type in types.values():
        assert node_type["node_config"]["ImageId"].startswith("resolve:ssm:/aws/service/deeplearning/")


def test_start_commands_expose_dashboard_and_metrics(config: dict) -> None:
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "--dashboard-host=0.0.0.0" in head and "--dashboard-port=8265" in head
    assert "--metrics-export-port=8080" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    workers = " ".join(config["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in workers and "--metrics-export-port=8080" in workers


def test_setup_installs_the_project_with_matching_versions(config: dict) -> None:
    setup = config["setup_commands"]
    # The checkout the file mount puts at ~/raylm, installed with the CUDA serving engine (pyproject's vllm-gpu extra).
    assert any(re.search(r'pip install .*-e "\$HOME/raylm\[vllm-gpu\]"', cmd) for cmd in setup)
    assert config["file_mounts"] == {"~/raylm": "."}
    assert ".venv" in config["rsync_exclude"]
    # The cluster must run the same Ray as the laptop that calls `ray up` / `ray job submit`.
    pins = [m.group(1) for cmd in setup for m in [re.search(r"ray\[[a-z,]+\]==([0-9.]+)", cmd)] if m]
    assert pins == [ray.__version__]
    # A torch pin exists and is a plain version (PyPI's Linux wheel is the CUDA build).
    assert any(re.search(r'"torch==\d+\.\d+\.\d+"', cmd) for cmd in setup)


# ---------------------------------------------------------------- job snippets

SNIPPETS = sorted(JOBS.glob("submit_*.sh"))
# The commands docs/formats.md fixes for each stage.
DESIGN_COMMANDS = {
    "submit_pipeline.sh": ["python -m pipeline run --input", "--output"],
    "submit_train.sh": ["python -m train --data", "--strategy", "--workers", "--steps", "python -m train.export --run"],
    "submit_serve.sh": ["python -m serve --model", "python -m serve.canary --endpoint", "--evalset"],
    "submit_job.sh": ["python -m cluster.run cluster/jobs/demo.yaml --address auto --set root=s3://bucket/raylm"],
}
# Arguments a snippet takes: the job snippet, a spec.
SNIPPET_ARGS = {"submit_job.sh": ["cluster/jobs/demo.yaml"]}


def test_every_stage_has_a_snippet() -> None:
    assert {p.name for p in SNIPPETS} == set(DESIGN_COMMANDS)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippet_is_valid_bash(snippet: Path) -> None:
    subprocess.run(["bash", "-n", str(snippet)], check=True)
    assert snippet.stat().st_mode & 0o111, "snippets should be executable"


@pytest.fixture(scope="module")
def submit_flags() -> set[str]:
    ray_cli = Path(sys.executable).parent / "ray"
    text = subprocess.run([str(ray_cli), "job", "submit", "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(--[a-z][a-z-]+)", text))


def _recorded_submissions(snippet: Path, tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """Run the snippet with a stand-in `ray` first on PATH that records its argv, one JSON list per call."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    path = f"{fake.parent}:/usr/bin:/bin"
    argv = ["bash", str(snippet), *SNIPPET_ARGS.get(snippet.name, [])]
    subprocess.run(argv, cwd=ROOT, env={"PATH": path, **env}, check=True)
    return [json.loads(line) for line in log.read_text().splitlines()]


SNIPPET_ENV = {
    "INPUT": "s3://bucket/crawl/*.warc.wet.gz",
    "ROOT": "s3://bucket/raylm/",
    "EVALSET": "evals/canary.jsonl",
}


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippet_submits_design_commands_with_working_dir(
    snippet: Path, submit_flags: set[str], tmp_path: Path
) -> None:
    calls = _recorded_submissions(snippet, tmp_path, SNIPPET_ENV)
    assert calls
    entrypoints = []
    for argv in calls:
        assert argv[:2] == ["job", "submit"]
        split = argv.index("--")
        options, entrypoint = argv[2:split], argv[split + 1 :]
        used = {w for w in options if w.startswith("--")}
        assert used <= submit_flags, used - submit_flags
        assert options[options.index("--working-dir") + 1] == "."
        assert options[options.index("--runtime-env") + 1] == "cluster/jobs/runtime_env.yaml"
        assert options[options.index("--address") + 1] == "http://127.0.0.1:8265"
        entrypoints.append(" ".join(entrypoint))
    joined = "\n".join(entrypoints)
    for fragment in DESIGN_COMMANDS[snippet.name]:
        assert fragment in joined


def test_pipeline_snippet_passes_the_glob_through_unexpanded(tmp_path: Path) -> None:
    (argv,) = _recorded_submissions(JOBS / "submit_pipeline.sh", tmp_path, SNIPPET_ENV)
    entrypoint = argv[argv.index("--") + 1 :]
    expected = "python -m pipeline run --input s3://bucket/crawl/*.warc.wet.gz --output s3://bucket/raylm/data"
    assert entrypoint == expected.split()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippets_hand_data_over_through_root_and_refuse_to_run_without_it(snippet: Path, tmp_path: Path) -> None:
    calls = _recorded_submissions(snippet, tmp_path, SNIPPET_ENV)
    # Every path a stage writes or reads from another stage is under ROOT: no node-local path crosses a job.
    handed = [
        a.removeprefix("root=")
        for argv in calls
        for flag, a in itertools.pairwise(argv)
        if flag in ("--output", "--data", "--run", "--model") or (flag == "--set" and a.startswith("root="))
    ]
    assert handed and all(a == "s3://bucket/raylm" or a.startswith("s3://bucket/raylm/") for a in handed), handed
    missing = subprocess.run(
        ["bash", str(snippet), *SNIPPET_ARGS.get(snippet.name, [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **{k: v for k, v in SNIPPET_ENV.items() if k != "ROOT"}},
    )
    assert missing.returncode != 0 and "ROOT=s3://" in missing.stderr


def test_runtime_env_is_valid_and_keeps_the_upload_small(tmp_path: Path) -> None:
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE, create_package
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    # Exactly what `ray job submit --working-dir . --runtime-env cluster/jobs/runtime_env.yaml` builds.
    env = parse_runtime_env_args(runtime_env=str(JOBS / "runtime_env.yaml"), working_dir=".")
    RuntimeEnv(**env)  # raises on unknown or malformed fields
    package = tmp_path / "working_dir.zip"
    # Without .gitignore help, so the excludes alone must keep the virtualenv and runs out.
    create_package(str(ROOT), package, include_gitignore=False, excludes=env["excludes"])
    import zipfile

    names = zipfile.ZipFile(package).namelist()
    assert "cluster/plan.py" in names and "ray_cluster.yaml" in names
    assert not any(n.startswith((".venv/", ".git/", "runs/")) or "__pycache__" in n for n in names)
    assert package.stat().st_size < GCS_STORAGE_MAX_SIZE // 2
