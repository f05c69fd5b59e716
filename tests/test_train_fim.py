"""Fill-in-the-middle (``fim``, train/fim.py): the rearranged windows' format in PSM and SPM order, the same for a
rank of any world size and a rerun, the pipeline's tokenizer carrying the sentinels and a tokenizer without them
refused naming them; and a tiny model trained on planted code-like documents with ``fim.rate: 0.5`` fills in a
held-out middle better than the same model trained with ``fim.rate: 0``."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from train_fixtures import build_token_dir, tiny_overrides

from ground.formats import EOT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, FIM_TOKENS
from pipeline.steps.tokenize import TokenizeConfig, train_tokenizer
from train.config import FimConfig, load_config
from train.data import TrainBatches
from train.fim import FimTransform
from train.final import train_to_completion
from train.manifest import load_manifest
from train.parallel import DistContext
from train.preflight import PreflightError, check_data
from train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
EOT_ID, PRE, SUF, MID = 0, 1, 2, 3


def transform(rate: float, mode: str = "psm", seed: int = 7) -> FimTransform:
    return FimTransform(FimConfig(rate=rate, mode=mode), seed, EOT_ID, PRE, SUF, MID)  # type: ignore[arg-type]


def documents_of(row: np.ndarray) -> list[list[int]]:
    pieces, current = [], []
    for token in row.tolist():
        if token == EOT_ID:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    return [*pieces, current]


@pytest.mark.parametrize("mode", ["psm", "spm"])
def test_every_document_is_rearranged_around_the_sentinels_at_rate_one(mode: str) -> None:
    docs = [list(range(10, 17)), list(range(20, 31)), list(range(40, 45))]
    row = np.array([*docs[0], EOT_ID, *docs[1], EOT_ID, *docs[2], EOT_ID, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59])
    out = transform(1.0, mode).apply(row, step=3, position=5)
    assert len(out) == len(row)  # cut back to the window: the last piece loses the 12 sentinels' room
    for original, got in zip(docs, documents_of(out), strict=False):
        assert got[0] == PRE and got.count(PRE) == got.count(SUF) == got.count(MID) == 1
        s, m = got.index(SUF), got.index(MID)
        if mode == "psm":  # <PRE> A <SUF> C <MID> B
            assert got[1:s] + got[m + 1 :] + got[s + 1 : m] == original
        else:  # <PRE> <SUF> C <MID> A B
            assert s == 1 and got[m + 1 :] + got[2:m] == original
    assert transform(1.0, mode).apply(row, step=3, position=5).tolist() == out.tolist()  # a rerun
    assert transform(0.0, mode).apply(row, step=3, position=5) is row


def test_the_rate_is_the_share_of_documents_and_each_row_draws_its_own() -> None:
    row = np.array([t for d in range(40) for t in (*range(10, 18), EOT_ID)])
    fim = transform(0.5)
    rearranged = [sum(PRE in d for d in documents_of(fim.apply(row, 0, p))) for p in range(25)]
    assert 0.4 < sum(rearranged) / (25 * 40) < 0.6
    assert len(set(rearranged)) > 1 and fim.apply(row, 0, 0).tolist() != fim.apply(row, 1, 0).tolist()


def test_a_rank_of_any_world_size_reads_the_rows_of_the_uninterrupted_single_run(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)
    fim = FimTransform.for_tokenizer(FimConfig(rate=0.5), 3, manifest.tokenizer_file())
    cpu = torch.device("cpu")

    def rows(rank: int, world: int) -> list[list[int]]:
        batches = TrainBatches(manifest, 32, 2, 4 // world, rank, world, 3, cpu, fim=fim)
        return [r.tolist() for tensor in batches.read_step(5) for r in tensor]

    single = rows(0, 1)
    assert rows(0, 2) + rows(1, 2) == single
    plain = [r.tolist() for t in TrainBatches(manifest, 32, 2, 4, 0, 1, 3, cpu).read_step(5) for r in t]
    assert plain != single and any(fim.prefix in r for r in single)


def test_the_pipelines_tokenizer_has_the_sentinels_and_a_tokenizer_without_them_is_refused(
    token_dir: Path, tmp_path: Path
) -> None:
    tokenizer = Tokenizer.from_file(str(token_dir / "tokenizer.json"))
    assert all(tokenizer.token_to_id(token) is not None for token in FIM_TOKENS)
    assert tokenizer.encode(f"{FIM_PREFIX}a{FIM_SUFFIX}b{FIM_MIDDLE}").ids[::2] == [
        tokenizer.token_to_id(t) for t in FIM_TOKENS
    ]  # each sentinel one token, as a prompt's text is encoded

    from tokenizers import decoders, models, pre_tokenizers, trainers

    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.decoder = decoders.ByteLevel()
    bare.train_from_iterator(["some text"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT]))
    data = build_token_dir(tmp_path / "data", tokenizer=bare)
    plain = load_config(None, tiny_overrides(data, tmp_path / "run"))
    check_data(plain)  # no fim: the sentinels are not needed
    with pytest.raises(PreflightError, match=f"fim.rate 0.5: .*tokenizer.json has no {FIM_PREFIX}, {FIM_SUFFIX}"):
        check_data(load_config(None, tiny_overrides(data, tmp_path / "run", **{"fim.rate": 0.5})))


NAMES = ("alpha", "beta", "gamma", "delta", "omega")


def code_document(name: int, n: int) -> str:
    """A planted code-like document whose middle (the first constant) only its suffix gives away: a left-to-right
    model can only guess it, a model that has learnt to read the suffix first can copy it."""
    return f"def {NAMES[name]}(x):\n    y = x * {n}\n    return y + {n}\n"


def middle_loss(trainer: Trainer, tokenizer: Tokenizer, docs: list[str]) -> float:
    """Mean loss of each held-out document's middle (`` N``, the constant) under the PSM format: <PRE> A <SUF> C <MID>
    then B, its parts tokenized apart, as a client sends them."""
    ids = {t: tokenizer.token_to_id(t) for t in (EOT, *FIM_TOKENS)}
    model = trainer.gpt.eval()
    losses = []
    for doc in docs:
        head, rest = doc.split(" * ", 1)
        middle, tail = rest.split("\n", 1)
        before, middle, after = (tokenizer.encode(t).ids for t in (head + " *", " " + middle, "\n" + tail))
        seq = [ids[EOT], ids[FIM_PREFIX], *before, ids[FIM_SUFFIX], *after, ids[FIM_MIDDLE], *middle]
        tokens = torch.tensor([seq])
        with torch.no_grad():
            logits, _ = model(tokens[:, :-1])
        scored = torch.log_softmax(logits[0, -len(middle) :].float(), dim=-1)
        losses.append(-float(scored[torch.arange(len(middle)), tokens[0, -len(middle) :]].mean()))
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_a_model_trained_with_fim_fills_in_a_held_out_middle_better(tmp_path: Path) -> None:
    # Held out: one name-constant pair in five (each constant is trained on, under the other names).
    pairs = [(name, n) for name in range(len(NAMES)) for n in range(10, 100)]
    held_out = [code_document(*pair) for pair in pairs if sum(pair) % 5 == 0]
    trained = [code_document(*pair) for pair in pairs if sum(pair) % 5]
    docs = random.Random(0).choices(trained, k=1200)
    tokenizer = train_tokenizer(docs, TokenizeConfig(vocab_size=300, min_frequency=1))
    data = build_token_dir(tmp_path / "code", docs=docs, tokenizer=tokenizer)
    torch.set_num_threads(1)
    losses = {}
    for rate in (0.0, 0.5):
        overrides = {"steps": 600, "checkpoint.enabled": False, "model.block_size": 64, "data.eval_interval": 0,
                     "guard.spike_factor": 1e6, "guard.loss_spike_factor": 0, "fim.rate": rate}  # fmt: skip
        config = load_config(None, tiny_overrides(data, tmp_path / f"run-{rate}", **overrides))
        check_data(config)
        trainer = Trainer.from_config(config, DistContext(0, 1, torch.device("cpu")))
        train_to_completion(trainer)
        losses[rate] = middle_loss(trainer, tokenizer, held_out)
    print(f"held-out middle loss (nats/token): fim.rate 0 {losses[0.0]:.3f}, fim.rate 0.5 {losses[0.5]:.3f}")
    # Better than the rate-0 model by a nat a token, and better than a uniform guess among the 90 constants: the
    # model reads the suffix.
    assert losses[0.5] < losses[0.0] - 1.0 and losses[0.5] < math.log(90), losses


@pytest.mark.parametrize("settings", [{"fim.rate": 1.5}, {"fim.rate": -0.1}, {"fim.mode": "pms"}])
def test_a_rate_outside_zero_to_one_or_an_unknown_mode_is_refused_naming_the_key(settings: dict) -> None:
    key = next(iter(settings))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, settings)
