"""Real Common Crawl text (cc_net "head", English), bundled in data/ccnet-text (data/README.md)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

CCNET_DIR = Path(__file__).resolve().parents[1] / "data" / "ccnet-text"
CCNET_FILES = sorted(CCNET_DIR.glob("*.jsonl.gz"))


def load_ccnet_texts() -> list[str]:
    if not CCNET_FILES:
        raise FileNotFoundError(f"{CCNET_DIR}: no *.jsonl.gz")
    texts = []
    for path in CCNET_FILES:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            texts += [json.loads(line)["text"] for line in lines if line.strip()]
    return texts
