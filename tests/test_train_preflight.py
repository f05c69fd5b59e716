"""Bad input is refused on the driver, before Ray or any worker starts, with a message saying why."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from train_fixtures import tiny_overrides

from train.config import load_config
from train.preflight import PreflightError, check_data, check_resources

REPO = Path(__file__).parents[1]


def config_for(data_dir: Path, tmp_path: Path, **extra: object):
    return load_config(None, tiny_overrides(data_dir, tmp_path / "run", **extra))


def copy_data(token_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(token_dir, tmp_path / "data"))


def test_good_data_fills_vocab_from_manifest(token_dir: Path, tmp_path: Path) -> None:
    config = config_for(token_dir, tmp_path)
    manifest = check_data(config)
    assert config.model.vocab_size == manifest.vocab_size == 512


def test_data_dir_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"no manifest\.json"):
        check_data(config_for(tmp_path / "empty", tmp_path))


def test_manifest_vocab_disagrees_with_tokenizer(token_dir: Path, tmp_path: Path) -> None:
    data = copy_data(token_dir, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 1024
    (data / "manifest.json").write_text(json.dumps(manifest))
    message = r"vocab mismatch: manifest says vocab_size=1024 but tokenizer\.json has 512"
    with pytest.raises(PreflightError, match=message):
        check_data(config_for(data, tmp_path))


def test_tokenizer_replaced_after_tokenization(token_dir: Path, tmp_path: Path) -> None:
    data = copy_data(token_dir, tmp_path)
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save(str(data / "tokenizer.json"))
    with pytest.raises(PreflightError, match="does not match the sha256"):
        check_data(config_for(data, tmp_path))


def test_model_vocab_disagrees_with_data(token_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"model.vocab_size=50257 but the data's tokenizer has 512"):
        check_data(config_for(token_dir, tmp_path, **{"model.vocab_size": 50257}))


def test_block_size_longer_than_any_shard(token_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"block_size 100000 needs windows of 100001 tokens.*longest train shard"):
        check_data(config_for(token_dir, tmp_path, **{"model.block_size": 100_000}))


def test_shard_truncated_on_disk(token_dir: Path, tmp_path: Path) -> None:
    data = copy_data(token_dir, tmp_path)
    shard = data / "tokens" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(PreflightError, match="bytes on disk"):
        check_data(config_for(data, tmp_path))


def test_more_workers_than_cpus_or_gpus(token_dir: Path, tmp_path: Path) -> None:
    config = config_for(token_dir, tmp_path, **{"parallel.strategy": "ddp", "parallel.workers": 4})
    with pytest.raises(PreflightError, match="needs 4 CPUs; the Ray cluster has 2"):
        check_resources(config, {"CPU": 2.0})
    config.parallel.use_gpu = True
    with pytest.raises(PreflightError, match="needs 4 GPUs; the Ray cluster has 0"):
        check_resources(config, {"CPU": 64.0})
    check_resources(config, {"CPU": 64.0, "GPU": 4.0})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.slow
def test_cli_reports_bad_input_without_starting_ray(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli("--data", str(tmp_path / "empty"), "--output", str(tmp_path / "run"), "--steps", "5")
    assert result.returncode == 2
    assert "error:" in result.stderr and "no manifest.json" in result.stderr
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()

    result = run_cli("--data", "x", "--output", "y", "--set", "optimizer.warmup_step=3")
    assert result.returncode == 2 and "warmup_step" in result.stderr


def test_cli_help() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--data", "--output", "--strategy", "--workers", "--steps", "--config", "--address", "--set"):
        assert flag in result.stdout


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cli_refuses_a_resume_into_another_model_without_starting_ray(token_dir: Path, tmp_path: Path) -> None:
    import torch

    from train.parallel import DistContext
    from train.trainer import Trainer

    run = tmp_path / "run"
    overrides = tiny_overrides(token_dir, run, **{"steps": 4, "checkpoint.interval_steps": 4})
    config = load_config(None, overrides)
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    trainer.train()
    trainer.close()
    paths_keys = ("data_dir", "output_dir")  # given as --data and --output below
    same = [arg for key, value in overrides.items() if key not in paths_keys for arg in ("--set", f"{key}={value}")]
    paths = ("--data", str(token_dir), "--output", str(run), "--resume")

    result = run_cli(*paths, *same, "--set", "model.n_embd=64", "--set", "model.activation=gelu")
    assert result.returncode == 2, result.stderr
    assert (
        f"{run / 'checkpoint_step_000000004'} was written by a run with model.activation='gelu_tanh', model.n_embd=32;"
        " this run has model.activation='gelu', model.n_embd=64" in " ".join(result.stderr.split())
    ), result.stderr
    assert "Started a local Ray instance" not in result.stdout + result.stderr
