"""classifier: a trained fastText quality classifier (the DCLM / FineWeb-Edu recipe) after the quality rules.

Training (``python -m pipeline classifier train``, :func:`train_classifier`) fits a fastText supervised model on
two text files, ``__label__hq`` (positive: text like the data you want) against ``__label__lq`` (negative:
random web text), as DCLM's ``fasttext_oh_eli5`` was trained (OpenHermes/ELI5 against RefinedWeb). It reports
accuracy on a held-out part chosen by a hash of each document (so it does not depend on file order) and writes
``MODEL.bin.json`` beside the model: the training files' sha256, counts, hyperparameters and that accuracy.

The step (:class:`QualityClassifier`) stores P(hq) of every document it sees as ``classifier_score`` and drops
those below ``classifier.threshold`` with reason ``classifier:low_score``.

How the model reaches the workers: by path, loaded once per worker process (:func:`load_classifier`, a cache
keyed by path and sha256). A fastText model is a C++ object that does not pickle, so putting it in the Ray
object store would mean shipping its bytes and writing them back to a file in each worker to load them; the
path costs nothing and, like ``--output``, must be one every node sees. The driver hashes the file once (the
hash goes to the manifest and the ``--resume`` check) and hands the hash to the tasks; a worker checks it on
its one load, so a model replaced during a run is an error, not a silent mix of two models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from ground.hashing import sha256_file
from pipeline.errors import PipelineInputError
from pipeline.steps.base import Doc, Step, drop
from pipeline.steps.decontaminate import _JSONL_SUFFIXES, _open_text
from pipeline.steps.language import normalise_for_lid
from pipeline.steps.verified_models import VerifiedModels

STAGE = "classifier"
REASON = "classifier:low_score"
SCORE_COLUMN = "classifier_score"
HQ, LQ = "__label__hq", "__label__lq"

log = logging.getLogger(__name__)


class ClassifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # A model from ``python -m pipeline classifier train``; null (the default) switches the stage off: there is
    # no universally right notion of "high quality", so the model is the user's choice.
    model: str | None = None
    # Keep documents with P(hq) >= threshold. 0.5 is the classifier's own decision boundary; DCLM instead keeps
    # a top fraction (the top 10% of its pool), which is a threshold read off the score distribution.
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    # Score the first characters only, like language id: fastText averages word vectors, so a long page's score
    # settles early while the cost keeps growing. None: the whole text.
    max_chars: int | None = Field(20_000, ge=1)

    @property
    def active(self) -> bool:
        return self.enabled and self.model is not None


def normalise(text: str, max_chars: int | None = None) -> str:
    """One line for fastText, the same for training and scoring (fastText reads up to the first newline)."""
    return normalise_for_lid(text, max_chars)


# ---- the model: loaded once per worker process -------------------------------------------------------------


def describe_model(path: str) -> dict:
    """What the manifest and the resume check record of the model file; a missing file is an error naming it."""
    file = Path(path)
    if not file.is_file():
        raise PipelineInputError(f"{path}: quality classifier model not found (classifier.model)")
    return {"path": path, "sha256": sha256_file(file), "bytes": file.stat().st_size}


_CLASSIFIERS = VerifiedModels("quality classifier model", describe_model)


def load_classifier(path: str, sha256: str | None = None) -> Any:
    """The fastText model at ``path``, loaded once per process and cached by (path, sha256). With ``sha256``
    given (the driver's hash), a cache hit costs nothing and a first load checks the file still has it."""
    return _CLASSIFIERS.get(path, sha256, lambda: _load_fasttext(path))


def _load_fasttext(path: str) -> Any:
    import fasttext

    try:
        model = fasttext.load_model(path)
    except ValueError as err:
        raise PipelineInputError(f"{path}: not a fastText model ({err})") from err
    if set(model.get_labels()) != {HQ, LQ}:
        raise PipelineInputError(f"{path}: labels {model.get_labels()}, expected {HQ} and {LQ}")
    return model


def hq_scores(model: Any, texts: list[str], max_chars: int | None = None) -> list[float]:
    """P(hq) for each text (``k=-1``: both labels' probabilities, whatever their order)."""
    if not texts:
        return []
    labels, probs = model.predict([normalise(t, max_chars) for t in texts], k=-1)
    scores = []
    for label_row, prob_row in zip(labels, probs, strict=True):
        by_label = dict(zip(label_row, prob_row, strict=True))
        # fastText's softmax can exceed 1 by a rounding hair; scores are probabilities.
        scores.append(min(1.0, max(0.0, float(by_label.get(HQ, 0.0)))))
    return scores


class QualityClassifier(Step):
    """Sets ``classifier_score`` = P(hq) and drops documents below the threshold (``classifier:low_score``)."""

    name = STAGE
    summary = "a fastText quality classifier's P(hq) (classifier_score); drops below the threshold"
    columns = (pa.field(SCORE_COLUMN, pa.float64()),)
    config_model = ClassifierConfig

    @classmethod
    def from_run(cls, config: BaseModel | None, resources: Mapping[str, Any]) -> QualityClassifier:
        return cls(cast(ClassifierConfig, config), resources.get("classifier_sha256"))

    def __init__(self, config: ClassifierConfig | None = None, sha256: str | None = None) -> None:
        self.config = config or ClassifierConfig()
        self.sha256 = sha256
        if self.config.active:
            # Fail at construction (once per task), naming the file, rather than inside the first block.
            self.model = load_classifier(str(self.config.model), sha256)

    def apply(self, docs: list[Doc]) -> None:
        if not self.config.active:
            return
        scores = hq_scores(self.model, [d.get("text") or "" for d in docs], self.config.max_chars)
        for doc, score in zip(docs, scores, strict=True):
            doc[SCORE_COLUMN] = score
            if score < self.config.threshold:
                drop(doc, self.name, REASON)


# ---- training -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainParams:
    epochs: int = 5
    lr: float = 0.1
    ngrams: int = 2  # word n-grams: DCLM's classifier uses bigrams
    dim: int = 64
    # Hash buckets for the n-grams: fastText's default 2M × dim floats makes an 800 MB model at dim 100.
    bucket: int = 200_000
    min_count: int = 1
    seed: int = 0
    heldout_fraction: float = 0.1


def read_documents(path: str | Path) -> list[str]:
    """One document a line (plain text), or JSON lines with a ``text`` field (by extension: ``.jsonl``,
    ``.json``, ``.ndjson``, optionally ``.gz``); blank documents are skipped."""
    path = Path(path)
    if not path.is_file():
        raise PipelineInputError(f"{path}: training file not found")
    is_jsonl = path.name.lower().endswith(_JSONL_SUFFIXES)
    docs = []
    try:
        with _open_text(path) as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if is_jsonl:
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise PipelineInputError(f"{path}:{lineno}: not JSON ({err.msg})") from err
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise PipelineInputError(f"{path}:{lineno}: no text field")
                    line = obj["text"]
                text = normalise(line)
                if text:
                    docs.append(text)
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise PipelineInputError(f"{path}: cannot read training file ({err})") from err
    return docs


def is_heldout(text: str, seed: int, fraction: float) -> bool:
    """A pure function of the document's text: the split does not move when files are reordered or grow, and
    a document repeated in a file cannot sit on both sides."""
    digest = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _fit(train_file: str, output: str, params: TrainParams) -> None:
    """fastText training proper, run in a fresh process (see train_classifier)."""
    import fasttext

    model = fasttext.train_supervised(
        input=train_file,
        epoch=params.epochs,
        lr=params.lr,
        wordNgrams=params.ngrams,
        dim=params.dim,
        bucket=params.bucket,
        minCount=params.min_count,
        seed=params.seed,
        thread=1,
        verbose=0,
    )
    model.save_model(output)


def train_classifier(
    positive: str | Path, negative: str | Path, output: str | Path, params: TrainParams | None = None
) -> dict:
    """Train, evaluate on the held-out part, save ``output`` and ``output.json``; return that JSON's content."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    params = params or TrainParams()
    labelled = [(HQ, t) for t in read_documents(positive)] + [(LQ, t) for t in read_documents(negative)]
    for label, path in ((HQ, positive), (LQ, negative)):
        if not any(lab == label for lab, _ in labelled):
            raise PipelineInputError(f"{path}: no documents")
    train = [(lab, t) for lab, t in labelled if not is_heldout(t, params.seed, params.heldout_fraction)]
    heldout = [(lab, t) for lab, t in labelled if is_heldout(t, params.seed, params.heldout_fraction)]
    # fastText reads the file in order and its SGD depends on that order: shuffle with the seed, so classes mix
    # and the result is a pure function of the inputs and the seed (with thread=1; more threads race).
    random.Random(params.seed).shuffle(train)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", suffix=".txt", dir=output.parent, prefix=f".{output.name}.train-"
    ) as tmp:
        tmp.writelines(f"{lab} {t}\n" for lab, t in train)
        tmp.flush()
        # A fresh process per training: with the installed fastText wheel (fasttext-numpy2-wheel 0.9.2), the
        # 1st-4th train_supervised calls of a process give the same model, later ones other models or
        # "Encountered NaN" (measured: 8 of 12 calls in one loop) — state left behind by earlier trainings.
        # The first training of a process is reproducible, so each one gets its own (spawn: no inherited state).
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(_fit, tmp.name, str(output), params).result()
    model = load_classifier(str(output))
    correct = 0
    if heldout:
        scores = hq_scores(model, [t for _, t in heldout])
        correct = sum((s >= 0.5) == (lab == HQ) for (lab, _), s in zip(heldout, scores, strict=True))
    meta = {
        "model": {"path": output.name, "sha256": sha256_file(output), "bytes": output.stat().st_size},
        "training_files": {
            "positive": {"path": str(positive), "sha256": sha256_file(Path(positive))},
            "negative": {"path": str(negative), "sha256": sha256_file(Path(negative))},
        },
        "counts": {
            "train": {"hq": sum(lab == HQ for lab, _ in train), "lq": sum(lab == LQ for lab, _ in train)},
            "heldout": {"hq": sum(lab == HQ for lab, _ in heldout), "lq": sum(lab == LQ for lab, _ in heldout)},
        },
        "hyperparameters": {**params.__dict__, "thread": 1},
        "heldout_accuracy": round(correct / len(heldout), 6) if heldout else None,
    }
    if not heldout:
        log.warning(
            "no held-out documents (%d in all, heldout_fraction %s): accuracy not measured",
            len(labelled),
            params.heldout_fraction,
        )
    Path(f"{output}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
