"""Evaluation by lm-evaluation-harness (the `lm-eval` package), a harness nobody here wrote, on tasks over real
held-out text (serve/harness_tasks.py): the same trained model scored through the live Ray Serve endpoint
(`local-completions`: loglikelihood through `echo` + `logprobs`) and through the Hugging Face export (`hf`) must
agree, and the canary's own scorer (echo + logprobs, serve.canary.score_text) must give the harness's log-likelihoods on
the same items.

One module-scoped set-up: a 40-step CPU run of a 128-token-context model on the cc_net sample, both exports, the
tasks (the sample's held-out documents, cut to fit one context window), one Ray Serve app."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
import torch
from serve_fixtures import running_app
from train_fixtures import load_documents, tiny_overrides

from serve.canary import Canary, score_text
from serve.evalset import load_evalset
from serve.harness_tasks import CLOZE_TASK, PPL_TASK, build_tasks
from serve.model_dir import read_export
from train.config import load_config
from train.export import export
from train.final import train_to_completion
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import Trainer

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files; nothing may reach a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lm_eval

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
BLOCK = 128
REL_TOL = 1e-4  # the two backends run the same weights through different code (ours vs transformers'), in fp32


@pytest.fixture(scope="module")
def setup(token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("harness")
    # A pipeline output dir: token_dir's shards and tokenizer, plus its held-out documents as documents/val-*.parquet
    # (build_token_dir puts every 5th document, from the second on, in the val split).
    data = root / "data"
    shutil.copytree(token_dir, data)
    (data / "documents").mkdir()
    val = [doc for i, doc in enumerate(load_documents()) if i % 5 == 1]
    pq.write_table(pa.table({"text": val}), data / "documents" / "val-00000.parquet")

    torch.set_num_threads(1)
    # One 32-wide head: vLLM's CPU attention has kernels for head sizes from 32 up (model_dir.check_cpu_attention).
    overrides = {"model.block_size": BLOCK, "model.n_head": 1, "checkpoint.enabled": False}
    config = load_config(None, tiny_overrides(data, root / "run", steps=40, **overrides))
    check_data(config)
    train_to_completion(Trainer(config, DistContext(rank=0, world_size=1, device=torch.device("cpu"))))
    raylm_dir, hf_dir = export(root / "run", root / "model"), export(root / "run", root / "model-hf", "hf")
    tasks = build_tasks(data, root / "tasks", items=16, max_tokens=BLOCK - 2)
    with running_app({"model": str(raylm_dir), "metrics_sd_dir": None}) as url:
        lineage_id = read_export(raylm_dir).lineage_id
        yield {"url": url, "hf": hf_dir, "tasks": tasks, "model": raylm_dir.name, "lineage_id": lineage_id}


def evaluate(setup: dict[str, Any], backend: str) -> dict[str, Any]:
    if backend == "hf":
        # add_bos_token=False: the harness puts its own prefix token (<|endoftext|>) before a rolling window; the
        # export's tokenizer would add a second one for a text (its document start, what vLLM's prompts get).
        model_args = f"pretrained={setup['hf']},dtype=float32,add_bos_token=False"
    else:
        # max_length: the harness keeps one token for generation, so windows are max_length - 1 = BLOCK - 1 long.
        model_args = (
            f"model={setup['model']},base_url={setup['url']}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={setup['hf']},max_length={BLOCK},num_concurrent=1,max_retries=1"
        )
    return lm_eval.simple_evaluate(
        model=backend if backend == "hf" else "local-completions",
        model_args=model_args,
        tasks=[PPL_TASK, CLOZE_TASK],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(setup["tasks"])),
        batch_size=4,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def results(setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {backend: evaluate(setup, backend) for backend in ("local-completions", "hf")}


def test_both_backends_score_every_item(setup: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    items = load_evalset(setup["tasks"] / "canary-evalset.jsonl").items
    cloze_items = (setup["tasks"] / f"{CLOZE_TASK}.jsonl").read_text().splitlines()
    assert len(items) >= 4 and len(cloze_items) >= 4  # every held-out document of the sample
    for backend, result in results.items():
        samples = result["samples"]
        assert len(samples[PPL_TASK]) == len(items), backend
        assert len(samples[CLOZE_TASK]) == len(cloze_items), backend
        ppl = result["results"][PPL_TASK]
        assert math.isfinite(ppl["word_perplexity,none"]) and ppl["word_perplexity,none"] > 1, backend


def test_the_endpoint_and_the_hf_export_agree_on_every_metric(results: dict[str, dict[str, Any]]) -> None:
    served, hf = results["local-completions"]["results"], results["hf"]["results"]
    for task in (PPL_TASK, CLOZE_TASK):
        metrics = [key for key in hf[task] if key.endswith(",none") and "stderr" not in key]
        assert metrics, task
        for key in metrics:
            assert served[task][key] == pytest.approx(hf[task][key], rel=REL_TOL), (task, key)


def per_item_loglik(result: dict[str, Any]) -> dict[str, float]:
    """Item text -> the harness's total log-likelihood of it (loglikelihood_rolling)."""
    return {s["doc"]["text"]: float(s["filtered_resps"][0]) for s in result["samples"][PPL_TASK]}


def test_the_canary_scores_what_the_harness_scores(setup: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    evalset = load_evalset(setup["tasks"] / "canary-evalset.jsonl")
    harness = {backend: per_item_loglik(result) for backend, result in results.items()}
    total_logprob = total_tokens = 0.0
    session = requests.Session()
    for item in evalset.items:
        logprob, tokens, lineage_id = score_text(session, setup["url"], setup["model"], item.text, timeout=60)
        assert lineage_id == setup["lineage_id"]  # the response names the weights that scored it
        for backend, loglik in harness.items():
            assert logprob == pytest.approx(loglik[item.text], rel=REL_TOL), (backend, item.id)
        total_logprob += logprob
        total_tokens += tokens
    canary = Canary(setup["url"], evalset, interval=60, min_score=None, timeout=60).run_once()
    assert canary["status"] == "success", json.dumps(canary)
    expected = sum(harness["hf"].values()) / total_tokens
    assert canary["score"] == pytest.approx(expected, rel=REL_TOL)
    assert canary["score"] == pytest.approx(total_logprob / total_tokens, rel=1e-9)
