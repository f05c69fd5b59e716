"""Data mixtures (train/mixture.py): several pipeline outputs at fixed weights. The realised share of each source
against its weight, determinism in (seed, step, rank), every rank's slice of the same global batch, lineage, a
bitwise resume, and the refusals (two tokenizers, a bad --data spec)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_ranks import FlushedQueue, cpu_rank, run_gloo_ranks
from remote_servers import moto_server, upload_dir, use_s3_endpoint
from tokenizers import Tokenizer
from train_fixtures import build_token_dir, tiny_overrides

from ground.hashing import sha256_file
from train.__main__ import main as train_main
from train.__main__ import overrides_from_args, parse_args
from train.config import ReweightConfig, TrainConfig, load_config
from train.data import TrainBatches
from train.final import train_to_completion
from train.heldout import HeldOutError, read_texts
from train.manifest import load_manifest
from train.metrics import read_metrics
from train.mixture import AdaptiveWeights, MixtureWeights, Source, cumulative_counts, load_sources, parse_mixture
from train.parallel import DistContext
from train.preflight import PreflightError, check_data
from train.reweight import next_weights
from train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CPU = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "data" / "eval-sets" / "gsm8k-test.jsonl"


@pytest.fixture(scope="module")
def two_sources(token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two pipeline outputs with one tokenizer: the tests' token dir, and a copy whose train shard holds only its
    first half (so the sources differ in size and content)."""
    other = tmp_path_factory.mktemp("mixture") / "books"
    shutil.copytree(token_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    for shard in manifest["shards"]:
        if shard["split"] == "train":
            path = other / shard["path"]
            tokens = np.fromfile(path, dtype="<u2")[: shard["tokens"] // 2]
            tokens.tofile(path)
            shard["tokens"] = len(tokens)
            shard["sha256"] = sha256_file(path)
    (other / "manifest.json").write_text(json.dumps(manifest))
    return token_dir, other


def batches(sources: list[Source], rank: int = 0, world: int = 1, accum: int = 4) -> TrainBatches:
    return TrainBatches(sources, 16, 2, accum, rank, world, 1337, torch.device("cpu"))


def test_realised_share_follows_the_weights_at_every_step(two_sources: tuple[Path, Path]) -> None:
    web, books = (load_manifest(d) for d in two_sources)
    sources = [Source("web", web, 0.7), Source("books", books, 0.3)]
    loader = batches(sources)
    boundary = loader.sizes[0]  # window ids below it are web's
    global_batch, seen = 8, {"web": 0, "books": 0}
    for step in range(50):
        ids = loader.window_ids(step).reshape(-1)
        seen["books"] += int((ids >= boundary).sum())
        seen["web"] += int((ids < boundary).sum())
        total = (step + 1) * global_batch
        # The lighter source is within one sequence of its weight after every step; the heavier takes the rest.
        assert abs(seen["books"] - 0.3 * total) < 1 and seen["web"] + seen["books"] == total
    assert seen["books"] == int(0.3 * 50 * global_batch)
    # Each source walks its own epochs: books' windows in a full pass over it are each visited once.
    books_windows = np.concatenate([loader.window_ids(s).reshape(-1) for s in range(50)])
    books_windows = books_windows[books_windows >= boundary][: loader.sizes[1]]
    assert len(set(books_windows.tolist())) == len(books_windows)


def test_ranks_split_the_same_global_batch_and_it_is_a_pure_function_of_the_step(
    two_sources: tuple[Path, Path],
) -> None:
    web, books = (load_manifest(d) for d in two_sources)
    sources = [Source("web", web, 0.6), Source("books", books, 0.4)]
    single = batches(sources, accum=4)
    ranks = [batches(sources, rank=r, world=2, accum=2) for r in range(2)]
    for step in (0, 1, 7, 33):
        together = np.concatenate([r.window_ids(step).reshape(-1) for r in ranks])
        assert together.tolist() == single.window_ids(step).reshape(-1).tolist()
        assert batches(sources).window_ids(step).tolist() == single.window_ids(step).tolist()


def test_counts_never_decrease_even_for_tiny_weights() -> None:
    weights = np.array([0.01, 0.04, 0.95])
    previous = cumulative_counts(0, 32, weights)
    for step in range(1, 400):
        counts = cumulative_counts(step, 32, weights)
        assert (counts >= previous).all() and counts.sum() == 32 * step
        previous = counts


def mixture_config(data: Path, out: Path, mixture: list[dict], **extra: object) -> TrainConfig:
    overrides = tiny_overrides(data, out, steps=8, **{"checkpoint.interval_steps": 4, "data.mixture": mixture})
    config = load_config(None, overrides | extra)
    check_data(config)
    return config


def assert_resumes_bitwise(reference: Trainer, data: Path, out: Path, mixture: list[dict], **extra: object) -> None:
    """A run of ``mixture`` stopped after 5 steps (checkpointed after 4) and resumed repeats ``reference`` (the
    uninterrupted run, finished) loss for loss and weight for weight."""
    first = Trainer.from_config(mixture_config(data, out, mixture, **extra), CPU)
    for _ in range(5):
        first.run_step()
    first.checkpointer.close()
    resumed = Trainer.from_config(mixture_config(data, out, mixture, **extra, **{"checkpoint.resume": True}), CPU)
    resumed.train()
    got = [(r["step"], r["loss"]) for r in read_metrics(out)]
    assert got == [(r["step"], r["loss"]) for r in read_metrics(reference.config.output_dir)]
    for key, value in reference.gpt.state_dict().items():
        assert torch.equal(resumed.gpt.state_dict()[key], value), key


def test_a_mixture_run_resumes_bitwise_and_records_its_sources(two_sources: tuple[Path, Path], tmp_path: Path) -> None:
    web, books = two_sources
    mixture = [{"name": "web", "path": str(web), "weight": 0.7}, {"name": "books", "path": str(books), "weight": 0.3}]
    torch.set_num_threads(1)
    reference = Trainer.from_config(mixture_config(web, tmp_path / "ref", mixture), CPU)
    info = train_to_completion(reference)
    assert [s["name"] for s in info["data_sources"]] == ["web", "books"]
    assert [s["weight"] for s in info["data_sources"]] == [0.7, 0.3]
    assert info["data_manifest_sha256"] != load_manifest(web).sha256  # the lineage names the mixture
    assert_resumes_bitwise(reference, web, tmp_path / "run", mixture)


def test_a_source_in_object_storage_mixes_exactly_like_the_same_source_on_disk(
    two_sources: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One source of the mixture in a bucket (moto's S3 server), the other local: its shards are fetched into the
    node's cache, verified, and the run trains on the same windows, loss for loss, as with both on disk."""
    web, books = two_sources
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(1)

    def losses(books_path: str, out: Path) -> list[float]:
        mixture = [
            {"name": "web", "path": str(web), "weight": 0.7},
            {"name": "books", "path": books_path, "weight": 0.3},
        ]
        config = load_config(None, tiny_overrides(web, out, steps=4, **{"data.mixture": mixture}))
        check_data(config)
        trainer = Trainer.from_config(config, CPU)
        try:
            return [trainer.train_step()["loss"] for _ in range(4)]
        finally:
            trainer.close()

    on_disk = losses(str(books), tmp_path / "local")
    with moto_server() as endpoint:
        use_s3_endpoint(monkeypatch, endpoint)
        uri = upload_dir(endpoint, books, "raylm-mixture", "books")
        in_bucket = losses(uri, tmp_path / "bucket")
    assert in_bucket == on_disk
    assert any(p.is_file() for p in (tmp_path / "cache").rglob("*"))  # the bucket's shards came through the cache


def test_sources_with_different_tokenizers_are_refused_naming_them(token_dir: Path, tmp_path: Path) -> None:
    other = build_token_dir(tmp_path / "other", vocab_size=300)
    mixture = [{"name": "web", "path": str(token_dir), "weight": 1}, {"name": "code", "path": str(other), "weight": 1}]
    config = load_config(None, tiny_overrides(token_dir, tmp_path / "run", **{"data.mixture": mixture}))
    with pytest.raises(PreflightError, match=r"'web'.*'code'.*tokenized differently"):
        check_data(config)
    with pytest.raises(ValueError, match="tokenized differently"):
        load_sources(str(token_dir), config.data.mixture)


def test_data_flag_takes_a_weighted_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_mixture("web=s3://bucket/web:0.7,books=runs/books:0.3") == [
        {"name": "web", "path": "s3://bucket/web", "weight": 0.7},
        {"name": "books", "path": "runs/books", "weight": 0.3},
    ]
    args = parse_args(["--data", "web=runs/a:2,books=runs/b:1", "--output", str(tmp_path)])
    overrides = overrides_from_args(args)
    assert "data_dir" not in overrides and [m["name"] for m in overrides["data.mixture"]] == ["web", "books"]
    assert load_config(None, overrides).data_dir == "runs/a"  # the first source: the export's tokenizer
    assert train_main(["--data", "web=runs/a", "--output", str(tmp_path)]) == 2
    assert "name=DIR:weight" in capsys.readouterr().err


def test_each_source_is_evaluated_on_its_own_in_loss_and_bits_per_byte(
    two_sources: tuple[Path, Path], tmp_path: Path
) -> None:
    """Every evaluation records val_loss over the sources together, and each source's own loss and bits per byte:
    its nats over its val windows' target tokens, by their UTF-8 bytes (the text they decode to), by ln 2."""
    web, books = two_sources
    mixture = [{"name": "web", "path": str(web), "weight": 0.5}, {"name": "books", "path": str(books), "weight": 0.5}]
    overrides = {"steps": 2, "data.eval_interval": 1, "checkpoint.enabled": False, "data.mixture": mixture}
    config = load_config(None, tiny_overrides(web, tmp_path / "run", **overrides))
    check_data(config)
    trainer = Trainer.from_config(config, CPU)
    fields = trainer.evaluate()
    assert set(fields) == {"val_loss", "val_loss/web", "val_bpb/web", "val_loss/books", "val_bpb/books"}
    tokenizer = Tokenizer.from_file(str(web / "tokenizer.json"))
    val = trainer.train_batches.val_set(0).by_source["web"]
    nats = text_bytes = 0.0
    with torch.no_grad():
        for batch in val:
            logits, _ = trainer.gpt(batch.inputs)
            nats += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
            )
            text_bytes += sum(len(tokenizer.decode(row.tolist()).encode()) for row in batch.targets)
    assert fields["val_bpb/web"] == pytest.approx(nats / text_bytes / math.log(2), rel=1e-5)
    train_to_completion(trainer)
    last = read_metrics(tmp_path / "run")[-1]
    assert {"val_loss/web", "val_bpb/web", "val_loss/books", "val_bpb/books"} <= set(last)


# ---- schedules: weights as a function of the step -----------------------------------------------------------------


def test_a_scheduled_mixture_anneals_and_brings_a_source_in_at_its_step() -> None:
    """Quality annealing (web 0.7 -> 0.3, books 0.3 -> 0.7 over steps 60..80) and code brought in at step 40: each
    step's counts follow the step's weights, never decrease, and add up to the global batch."""
    raw = [0.7, 0.3, 0.0]
    schedules = [((60, 0.7), (80, 0.3)), ((60, 0.3), (80, 0.7)), ((40, 0.0), (41, 0.2))]
    weights = MixtureWeights(raw, schedules)
    batch, previous = 32, np.zeros(3, dtype=np.int64)
    for step in range(1, 120):
        counts = weights.counts(step, batch)
        assert (counts >= previous).all() and counts.sum() == batch * step
        expected = sum(weights.at(t) for t in range(step)) * batch  # the shares summed step by step
        assert np.abs(counts - expected).max() <= len(raw) - 1  # within a sequence per other source
        previous = counts
    assert weights.counts(41, batch)[2] == 0 and weights.counts(45, batch)[2] > 0  # code: none before step 41
    np.testing.assert_allclose(weights.at(30), [0.7, 0.3, 0.0])
    np.testing.assert_allclose(weights.at(100), np.array([0.3, 0.7, 0.2]) / 1.2)  # normalised, held after the end
    fixed = MixtureWeights([0.7, 0.3], [(), ()])
    assert all((fixed.counts(t, batch) == cumulative_counts(t, batch, np.array([0.7, 0.3]))).all() for t in range(50))


def test_a_scheduled_mixture_resumes_bitwise_and_records_its_schedule(
    two_sources: tuple[Path, Path], tmp_path: Path
) -> None:
    web, books = two_sources
    mixture = [{"name": "web", "path": str(web), "weight": 1.0},
               {"name": "books", "path": str(books), "weight": 0.0,
                "schedule": [{"step": 3, "weight": 0.0}, {"step": 5, "weight": 1.0}]}]  # fmt: skip

    torch.set_num_threads(1)
    reference = Trainer.from_config(mixture_config(web, tmp_path / "ref", mixture), CPU)
    books_from = len(reference.train_batches.final.windows) - reference.train_batches.final.sizes[1]
    per_step = [(reference.train_batches.final.window_ids(step) >= books_from).sum() for step in range(8)]
    assert per_step[:4] == [0, 0, 0, 0] and per_step[5] > 0  # books come in from step 4 on, by its schedule
    info = train_to_completion(reference)
    assert info["data_sources"][1]["schedule"] == [{"step": 3, "weight": 0.0}, {"step": 5, "weight": 1.0}]
    assert_resumes_bitwise(reference, web, tmp_path / "run", mixture)


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"weight": 0.5, "schedule": [{"step": 5, "weight": 1}, {"step": 5, "weight": 2}]}, "steps must increase"),
        ({"weight": 0.0}, "weight 0 and no schedule that raises it"),
        ({"weight": 0.0, "schedule": [{"step": 5, "weight": 0.0}]}, "weight 0 and no schedule that raises it"),
    ],
)
def test_a_schedule_that_cannot_be_followed_is_refused_naming_the_source(entry: dict, named: str) -> None:
    mixture = [{"name": "web", "path": "a", "weight": 1.0}, {"name": "books", "path": "b", **entry}]
    with pytest.raises(ValueError, match=f"'books'.*{named}|{named}"):
        load_config(None, {"data.mixture": mixture})
    # Each source falls to 1/21 of the batch at one end of the schedule: the one taking the rest could lose a count.
    swap = [{"name": "web", "path": "a", "weight": 1.0, "schedule": [{"step": 10, "weight": 0.05}]},
            {"name": "books", "path": "b", "weight": 0.05, "schedule": [{"step": 10, "weight": 1.0}]}]  # fmt: skip
    with pytest.raises(ValueError, match="too small to mix 2 sources"):
        load_config(None, {"data.global_batch_size": 8, "data.micro_batch_size": 8, "data.mixture": swap})


# ---- reweighting: the weights follow the per-source evaluation ------------------------------------------------------


def test_reweighting_moves_weight_to_the_sources_that_improved_least_within_bounds() -> None:
    weights, before = np.array([0.5, 0.3, 0.2]), np.array([4.0, 4.0, 4.0])
    now = np.array([3.0, 3.8, 3.5])  # web improved most, books least
    moved = next_weights(weights, before, now, ReweightConfig(rate=1.0, min_weight=0.1, max_weight=0.8))
    assert moved.sum() == pytest.approx(1.0) and moved[1] > weights[1] and moved[0] < weights[0]
    assert moved[1] / weights[1] > moved[2] / weights[2] > moved[0] / weights[0]  # in the order of improvement
    # A large step stops at the bounds, and the weights still sum to 1.
    pinned = next_weights(weights, before, now, ReweightConfig(rate=50.0, min_weight=0.1, max_weight=0.8))
    assert pinned.sum() == pytest.approx(1.0) and pinned.min() >= 0.1 - 1e-12 and pinned.max() <= 0.8 + 1e-12
    assert pinned[0] == pytest.approx(0.1)
    # Every source improving alike changes nothing.
    same = next_weights(weights, before, before * 0.9, ReweightConfig(rate=1.0))
    np.testing.assert_allclose(same, weights)


def test_adaptive_counts_follow_each_piece_and_never_decrease() -> None:
    weights = AdaptiveWeights(np.array([0.7, 0.3]))
    weights.change(5, np.array([0.4, 0.6]))
    weights.change(9, np.array([0.1, 0.9]))
    batch, previous = 8, np.zeros(2, dtype=np.int64)
    for step in range(1, 30):
        counts = weights.counts(step, batch)
        assert (counts >= previous).all() and counts.sum() == batch * step
        expected = sum(weights.at(t) for t in range(step)) * batch
        assert np.abs(counts - expected).max() <= 1
        previous = counts
    with pytest.raises(ValueError, match="before the last one"):
        weights.change(7, np.array([0.5, 0.5]))


@pytest.fixture(scope="module")
def web_and_math(token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two domains with one tokenizer: the tests' token dir (web text), and GSM8K's questions (the set the repository
    ships) tokenized by its tokenizer, so the two val splits differ and the model learns them at different rates."""
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:400]]
    math = build_token_dir(
        tmp_path_factory.mktemp("mixture") / "math", docs=questions,
        tokenizer=Tokenizer.from_file(str(token_dir / "tokenizer.json")),
    )  # fmt: skip
    # The same tokenizer, byte for byte (a mixture checks its sha256).
    shutil.copyfile(token_dir / "tokenizer.json", math / "tokenizer.json")
    manifest = json.loads((math / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = sha256_file(math / "tokenizer.json")
    (math / "manifest.json").write_text(json.dumps(manifest))
    return token_dir, math


REWEIGHT = {"data.eval_interval": 2, "data.reweight": {"rate": 2.0, "min_weight": 0.2, "max_weight": 0.8}}


def web_and_math_mixture(web: Path, math: Path) -> list[dict]:
    return [{"name": "web", "path": str(web), "weight": 0.5}, {"name": "math", "path": str(math), "weight": 0.5}]


def test_a_reweighted_run_follows_its_evaluations_and_resumes_bitwise(
    web_and_math: tuple[Path, Path], tmp_path: Path
) -> None:
    """An evaluation every 2 steps moves the weights (rate 2, within [0.2, 0.8]) toward the source whose val loss
    fell least since the evaluation before; the loader mixes each later step by them; final.json keeps every piece;
    and a run stopped after the step-4 checkpoint resumes to the same losses and weights (the pieces and the last
    losses ride in the checkpoint)."""
    web, math = web_and_math
    mixture, reweight = web_and_math_mixture(web, math), REWEIGHT
    torch.set_num_threads(1)
    reference = Trainer.from_config(mixture_config(web, tmp_path / "ref", mixture, **reweight), CPU)
    info = train_to_completion(reference)
    evals = [r for r in read_metrics(tmp_path / "ref") if "val_loss/web" in r]
    assert [r["step"] for r in evals] == [1, 3, 5, 7]
    pieces = info["mixture_weights"]
    assert [p["from_data_step"] for p in pieces] == [0, 4, 6, 8]  # the first evaluation only sets the baseline
    previous = pieces[0]["weights"]
    for earlier, later, piece in zip(evals[:-1], evals[1:], pieces[1:], strict=True):
        fell = {name: 1 - later[f"val_loss/{name}"] / earlier[f"val_loss/{name}"] for name in ("web", "math")}
        slower = min(fell, key=lambda name: fell[name])
        weight = piece["weights"]
        assert weight[slower] > previous[slower] or weight[slower] == pytest.approx(0.8)  # the slower one gained
        assert sum(weight.values()) == pytest.approx(1.0) and min(weight.values()) >= 0.2 - 1e-12
        assert later[f"mixture_weight/{slower}"] == weight[slower]
        previous = weight
    # Each step draws math windows in its piece's proportion (within the cumulative counts' floor).
    loader = reference.train_batches.final
    math_from = len(loader.windows) - loader.sizes[1]
    drawn = [int((loader.window_ids(step) >= math_from).sum()) for step in range(8)]
    expected = [loader.weights.at(step)[1] * 8 for step in range(8)]
    assert all(abs(got - want) <= 1 for got, want in zip(drawn, expected, strict=True)), (drawn, expected)
    assert len({round(w, 9) for w in expected}) > 1  # the weights did move
    assert_resumes_bitwise(reference, web, tmp_path / "run", mixture, **reweight)


def _reweighted_ddp_worker(
    rank: int, world: int, port: int, web: str, math: str, out: str, queue: FlushedQueue
) -> None:
    """A reweighted DDP-2 run whole, and stopped after 5 steps (checkpointed after 4) then resumed: each rank's
    weight pieces, and whether the resumed weights equal the whole run's."""
    mixture = web_and_math_mixture(Path(web), Path(math))
    ddp = {**REWEIGHT, "parallel.strategy": "ddp", "parallel.workers": 2}
    with cpu_rank(rank, world, port) as ctx:
        whole = Trainer.from_config(mixture_config(Path(web), Path(out) / "whole", mixture, **ddp), ctx)
        whole.train()
        cut = Trainer.from_config(mixture_config(Path(web), Path(out) / "cut", mixture, **ddp), ctx)
        for _ in range(5):
            cut.run_step()
        cut.checkpointer.close()
        resumed = Trainer.from_config(
            mixture_config(Path(web), Path(out) / "cut", mixture, **ddp, **{"checkpoint.resume": True}), ctx
        )
        resumed.train()
        weights = resumed.gpt.state_dict()
        same = all(torch.equal(value, weights[name]) for name, value in whole.gpt.state_dict().items())
        assert whole.reweighter is not None and resumed.reweighter is not None
        queue.put({"rank": rank, "whole": whole.reweighter.history(), "resumed": resumed.reweighter.history(),
                   "same": same})  # fmt: skip


@pytest.mark.slow
def test_a_reweighted_ddp_run_moves_every_ranks_weights_alike_and_resumes_bitwise(
    web_and_math: tuple[Path, Path], tmp_path: Path
) -> None:
    """Under DDP on 2 ranks, every rank computes the same weights from the evaluation (its losses summed across the
    ranks), and a resume repeats the whole run's losses, weights and pieces."""
    web, math = web_and_math
    results = run_gloo_ranks(_reweighted_ddp_worker, 2, str(web), str(math), str(tmp_path))
    assert results[0]["whole"] == results[1]["whole"] and len(results[0]["whole"]) == 4
    assert len({json.dumps(p["weights"]) for p in results[0]["whole"]}) == 4  # every evaluation moved them
    for result in results:
        assert result["resumed"] == result["whole"] and result["same"], result
    losses = [[(r["step"], r["loss"]) for r in read_metrics(tmp_path / name)] for name in ("whole", "cut")]
    assert len(losses[0]) == 8 and losses[1] == losses[0]


def test_reweighting_that_cannot_be_followed_is_refused_naming_why() -> None:
    two = [{"name": "web", "path": "a", "weight": 0.5}, {"name": "books", "path": "b", "weight": 0.5}]
    on = {"data.reweight": {"rate": 1.0}}
    with pytest.raises(PreflightError, match=r"needs data\.mixture with 2 or more sources"):
        check_data(load_config(None, on | {"data_dir": "nowhere"}))
    with pytest.raises(ValueError, match=r"sources with a schedule: \['books'\]"):
        scheduled = [two[0], {**two[1], "schedule": [{"step": 5, "weight": 1.0}]}]
        load_config(None, {**on, "data.mixture": scheduled})
    with pytest.raises(ValueError, match=r"needs data\.eval_interval > 0"):
        load_config(None, {**on, "data.mixture": two, "data.eval_interval": 0})
    with pytest.raises(ValueError, match=r"sources \['books'\] start outside"):
        bounds = {"rate": 1.0, "min_weight": 0.1}  # books: 0.04 / 0.54 of the mixture
        load_config(None, {"data.mixture": [two[0], {**two[1], "weight": 0.04}], "data.reweight": bounds})
    with pytest.raises(ValueError, match="no 2 weights summing to 1 fit"):
        load_config(None, {"data.mixture": two, "data.reweight": {"rate": 1.0, "max_weight": 0.4}})


# ---- held-out text sets -----------------------------------------------------------------------------------------


def test_a_heldout_set_is_evaluated_beside_the_val_split_in_loss_and_bits_per_byte(
    token_dir: Path, tmp_path: Path
) -> None:
    """GSM8K's test questions (the set the repository ships) as a held-out yardstick: its windows are the questions'
    tokens, each followed by EOT, and every evaluation scores them like a source."""
    heldout = [{"name": "gsm8k", "path": str(GSM8K), "field": "question"}]
    overrides = {"steps": 1, "checkpoint.enabled": False, "data.heldout": heldout}
    config = load_config(None, tiny_overrides(token_dir, tmp_path / "run", **overrides))
    check_data(config)
    trainer = Trainer.from_config(config, CPU)
    fields = trainer.evaluate()
    assert set(fields) == {"val_loss", "val_loss/data", "val_bpb/data", "val_loss/gsm8k", "val_bpb/gsm8k"}
    assert fields["val_loss/data"] == fields["val_loss"]  # one source: the val split itself
    tokenizer = Tokenizer.from_file(str(token_dir / "tokenizer.json"))
    first_question = json.loads(GSM8K.read_text().splitlines()[0])["question"]
    first_window = next(iter(trainer.train_batches.val_set(0).by_source["gsm8k"])).inputs[0].tolist()
    stream = [*tokenizer.encode(first_question).ids, tokenizer.token_to_id("<|endoftext|>")]  # as a shard holds it
    assert first_window == stream[: len(first_window)]
    trainer.close()


@pytest.mark.parametrize(
    ("heldout", "named"),
    [
        (
            {"name": "gsm8k", "path": str(GSM8K), "field": "prompt"},
            "gsm8k-test.jsonl, line 1: no string field 'prompt'",
        ),
        ({"name": "gsm8k", "path": "no/such/file.jsonl"}, "no/such/file.jsonl"),
    ],
)
def test_a_heldout_set_that_cannot_be_read_is_refused_naming_file_and_field(
    heldout: dict, named: str, token_dir: Path, tmp_path: Path
) -> None:
    config = load_config(None, tiny_overrides(token_dir, tmp_path / "run", **{"data.heldout": [heldout]}))
    with pytest.raises(PreflightError, match=re.escape(named)):
        check_data(config)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    with pytest.raises(HeldOutError, match=r"blank\.txt: no documents"):  # nothing skipped silently
        read_texts(str(blank), "text")
    with pytest.raises(ValueError, match=r"data\.heldout names \['data'\]"):
        load_config(None, {"data.heldout": [{"name": "data", "path": str(GSM8K)}]})


def test_a_context_phase_follows_the_runs_step_in_a_mixture_schedule(two_sources: tuple[Path, Path]) -> None:
    """A loader that starts at the run's step 10 (a context phase's first) weighs its sources by the run's step:
    books, brought in at step 10, are in its first batch, where a loader from step 0 has none before its step 10."""
    web, books = two_sources
    mixture = [{"name": "web", "path": str(web), "weight": 1.0},
               {"name": "books", "path": str(books), "weight": 0.0,
                "schedule": [{"step": 9, "weight": 0.0}, {"step": 10, "weight": 1.0}]}]  # fmt: skip
    sources = load_sources(str(web), load_config(None, {"data.mixture": mixture}).data.mixture)

    def books_per_step(first_step: int) -> list[int]:
        loader = TrainBatches(sources, 32, 2, 2, 0, 1, 3, torch.device("cpu"), first_step=first_step)
        books_from = len(loader.windows) - loader.sizes[1]
        return [int((loader.window_ids(step) >= books_from).sum()) for step in range(12)]

    assert books_per_step(0)[:10] == [0] * 10 and books_per_step(0)[11] > 0
    assert books_per_step(10)[0] > 0
