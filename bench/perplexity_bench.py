"""The perplexity stage's cost per document on CPU, beside the fastText quality classifier's, on the same documents.

    .venv/bin/python bench/perplexity_bench.py --input data/sample --make-model bench/.cache/lm-6x384 \
        --layers 6 --width 384                                    # the demo model's shape (untrained: time only)
    .venv/bin/python bench/perplexity_bench.py --input data/sample --model DIR --rounds 1 --docs 8   # smallest

Reads the documents the pipeline's extract step keeps from ``--input`` (the first ``--docs``), then, over
``--rounds`` in alternating order, runs the ``perplexity`` step (``--model``: any Hugging Face causal-LM directory)
and the ``classifier`` step (``--classifier``: a fastText model; without one, a classifier is trained here on the
documents themselves, labels arbitrary, since only its speed is measured) on all of them. Model loading is outside
the timings (a worker loads each once). Prints each step's ms per document, median [IQR], and their ratio.

``--make-model DIR`` writes a raylm GPT of ``--layers`` x ``--width`` with untrained weights in the Hugging Face
layout (``train.hf_export``), with a BPE tokenizer trained on the documents: a forward pass costs the same
whatever the weights, so it times a model of that shape without training one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spread import quartiles  # noqa: E402  (bench/spread.py, beside this script)

from pipeline.sources import list_inputs  # noqa: E402
from pipeline.steps.base import is_dropped  # noqa: E402
from pipeline.steps.extract import read_wet  # noqa: E402
from pipeline.steps.perplexity import PerplexityConfig, PerplexityFilter  # noqa: E402
from pipeline.steps.quality_classifier import (  # noqa: E402
    ClassifierConfig,
    QualityClassifier,
    TrainParams,
    train_classifier,
)


def texts_of(input_dir: str, limit: int) -> list[str]:
    texts: list[str] = []
    for f in list_inputs(input_dir):
        texts += [d["text"] for d in read_wet(f.uri) if not is_dropped(d)]
    return texts[:limit]


def make_model(out: Path, texts: list[str], layers: int, width: int, context: int) -> Path:
    import torch

    from pipeline.steps.tokenize import TokenizeConfig, train_tokenizer
    from train.hf_export import export_hf
    from train.model import GPT, GPTConfig

    tokenizer = train_tokenizer(texts, TokenizeConfig(vocab_size=4096, min_frequency=1))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_path = out.parent / f"{out.name}.tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    torch.manual_seed(0)
    heads = max(1, width // 64)
    config = GPTConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=context, dropout=0.0, bias=True,
                       vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))  # fmt: skip
    export_hf(GPT(config).eval(), tokenizer_path, out, torch.arange(16).unsqueeze(0))
    return out


def fasttext_model(texts: list[str], work: Path) -> Path:
    positive, negative = work / "a.txt", work / "b.txt"
    positive.write_text("\n".join(t.replace("\n", " ") for t in texts[::2]) + "\n")
    negative.write_text("\n".join(t.replace("\n", " ") for t in texts[1::2]) + "\n")
    out = work / "classifier.bin"
    train_classifier(positive, negative, out, TrainParams(epochs=1, heldout_fraction=0.0))
    return out


def timed(step: object, texts: list[str]) -> float:
    docs = [{"text": t, "language": "en"} for t in texts]
    started = time.perf_counter()
    step(docs)  # type: ignore[operator]
    return (time.perf_counter() - started) * 1000 / len(texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a directory or glob of WARC/WET files")
    parser.add_argument("--docs", type=int, default=200, help="documents scored per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a Hugging Face causal-LM directory")
    model.add_argument("--make-model", metavar="DIR", help="write an untrained GPT of --layers x --width here, use it")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=PerplexityConfig().max_tokens)
    parser.add_argument("--batch-size", type=int, default=PerplexityConfig().batch_size)
    parser.add_argument("--classifier", help="a fastText model (default: one trained here, for its speed only)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # one pipeline worker's share: Ray gives each task or actor one CPU
    texts = texts_of(args.input, args.docs)
    if not texts:
        parser.error(f"{args.input}: no document kept by extract")
    lm = args.model or str(make_model(Path(args.make_model), texts, args.layers, args.width, args.max_tokens))
    with tempfile.TemporaryDirectory() as work:
        classifier = args.classifier or str(fasttext_model(texts, Path(work)))
        steps = {
            "perplexity": PerplexityFilter(
                PerplexityConfig(model=lm, max_tokens=args.max_tokens, batch_size=args.batch_size)
            ),
            "classifier": QualityClassifier(ClassifierConfig(model=classifier)),
        }
        ms: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.rounds):
            for name in sorted(steps, reverse=r % 2 == 1):  # alternate which goes first
                ms[name].append(timed(steps[name], texts))
    ratios = [p / c for p, c in zip(ms["perplexity"], ms["classifier"], strict=True)]
    mean_chars = sum(map(len, texts)) / len(texts)
    print(
        f"{len(texts)} documents from {args.input}, mean {mean_chars:,.0f} characters, {args.rounds} rounds, "
        f"1 torch thread; perplexity model {lm}, first {args.max_tokens} tokens, batches of {args.batch_size}\n"
    )
    print("| step | ms per document, median [IQR] |")
    print("|---|---|")
    for name, values in ms.items():
        mid, q1, q3 = quartiles(values)
        print(f"| {name} | {mid:.3f} [{q1:.3f}, {q3:.3f}] |")
    mid, q1, q3 = quartiles(ratios)
    print(f"\nperplexity / classifier: {mid:.1f}x [{q1:.1f}, {q3:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
