"""Real Common Crawl text (cc_net "head", English) from the shared data folder beside the checkout."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CCNET_FILES = sorted((SHARED_DATA / "ccnet-text").glob("*.jsonl.gz"))


def load_ccnet_texts() -> list[str]:
    if not CCNET_FILES:
        raise FileNotFoundError(f"{SHARED_DATA / 'ccnet-text'}: no *.jsonl.gz (is shared/ beside the checkout?)")
    texts = []
    for path in CCNET_FILES:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            texts += [json.loads(line)["text"] for line in lines if line.strip()]
    return texts
