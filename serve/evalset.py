"""The canary's eval set: held-out documents from a pipeline output dir, as a versioned JSONL file.

Every line is self-describing: ``{"eval_set", "version", "id", "kind": "loglik", "text", "source"}``.
The version is a hash of the items' texts, so the same documents always give the same version and
any change to the set gives a new one; the canary labels its gauges ``eval_set="<name>@<version>"``,
which keeps scores of different sets from ever being compared by an alert.

Documents come from the pipeline's val split (``documents/val-*.parquet``, column ``text``) — text
the model was not trained on — in file and row order, so rebuilding is deterministic.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from ground.storage import Location

DataDir = str | Path | Location


class EvalSetError(ValueError):
    pass


@dataclass(frozen=True)
class EvalItem:
    id: str
    text: str


@dataclass(frozen=True)
class EvalSet:
    name: str
    version: str
    items: tuple[EvalItem, ...]

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


def _truncate(text: str, max_chars: int) -> str:
    """Cut at the last whitespace before max_chars, so no item ends inside a word."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind(" ", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars]


def fit_tokens(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """The longest prefix of ``text`` ending at a whitespace (or the whole text) with at most ``max_tokens``
    tokens: an item that fits one context window is scored the same way by every scorer (the canary's echo, the
    harness's rolling windows), with no windowing choices between them."""
    if count_tokens(text) <= max_tokens:
        return text
    cuts = [i for i, ch in enumerate(text) if ch.isspace()]
    lo, hi = 0, len(cuts)  # binary search for the number of usable cut points
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(text[: cuts[mid - 1]]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[: cuts[lo - 1]] if lo else ""


def version_of(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:12]


def build_evalset(
    data_dirs: DataDir | Sequence[DataDir],
    output: str | Path,
    name: str = "val-loglik",
    items: int = 16,
    min_chars: int = 200,
    max_chars: int = 1200,
    max_tokens: int | None = None,
) -> EvalSet:
    """The first ``items`` val documents of ``min_chars``+ characters, cut to ``max_chars`` (and, given
    ``max_tokens``, to that many tokens of the data's tokenizer), written to ``output`` as JSONL. A data dir is a
    path or an object-storage URI; ``output`` is a local file.

    Several data dirs (a mixture's curations, which share one tokenizer) give their documents in turn, one each
    while they last, so that every source with val documents is scored; a source with none gives no item, and
    each line's ``source`` says which dir it came from."""
    roots = [Location(d) for d in ([data_dirs] if isinstance(data_dirs, DataDir) else data_dirs)]
    count_tokens = _token_counter(roots[0].uri) if max_tokens is not None else None
    several = len(roots) > 1
    found: list[list[tuple[str, str, str]]] = []  # per dir: (id, text, source)
    for n, root in enumerate(roots):
        files = [f for f in root.files() if re.fullmatch(r"documents/val-[^/]*\.parquet", f)]
        if not files and not several:
            raise EvalSetError(f"{root}/documents has no val-*.parquet (a `python -m pipeline run` output dir?)")
        picked: list[tuple[str, str, str]] = []
        for file in files:
            path = Path(file)
            with root.join(file).open_input() as stream:
                texts = pq.read_table(stream, columns=["text"]).column("text").to_pylist()
            for row, text in enumerate(texts):
                if text and len(text.strip()) >= min_chars:
                    cut = _truncate(text.strip(), max_chars)
                    if count_tokens is not None and max_tokens is not None:
                        cut = fit_tokens(cut, count_tokens, max_tokens)
                    # A mixture's ids carry the source's place, since its dirs' file names repeat.
                    picked.append((f"{n}/{path.stem}:{row}" if several else f"{path.stem}:{row}", cut, root.uri))
                if len(picked) == items:
                    break
            if len(picked) == items:
                break
        found.append(picked)
    chosen = [doc for turn in itertools.zip_longest(*found) for doc in turn if doc is not None][:items]
    if not chosen:
        where = ", ".join(str(r) for r in roots)
        raise EvalSetError(f"no val document in {where} has {min_chars}+ characters")
    version = version_of([t for _, t, _ in chosen])
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for item_id, text, source in chosen:
            line = {"eval_set": name, "version": version, "id": item_id, "kind": "loglik", "text": text}
            line["source"] = source
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    return EvalSet(name, version, tuple(EvalItem(i, t) for i, t, _ in chosen))


def _token_counter(data_dir: str | Path) -> Callable[[str], int]:
    from tokenizers import Tokenizer

    from train.manifest import load_manifest

    tokenizer = Tokenizer.from_file(str(load_manifest(data_dir).tokenizer_file()))
    return lambda text: len(tokenizer.encode(text).ids)


def load_evalset(path: str | Path) -> EvalSet:
    lines = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise EvalSetError(f"{path} is empty")
    names = {(line["eval_set"], line["version"]) for line in lines}
    if len(names) != 1:
        raise EvalSetError(f"{path} mixes eval sets/versions: {sorted(names)}")
    if any(line.get("kind") != "loglik" for line in lines):
        raise EvalSetError(f"{path}: only kind=loglik items are supported")
    items = tuple(EvalItem(line["id"], line["text"]) for line in lines)
    name, version = names.pop()
    if version_of([i.text for i in items]) != version:
        raise EvalSetError(f"{path}: texts do not match version {version} (edited by hand?)")
    return EvalSet(name, version, items)
