"""lm-evaluation-harness tasks over a pipeline output's held-out text, so a harness nobody here wrote scores the model.

``python -m serve.harness_tasks --data DATA --output DIR`` writes two task YAMLs and their local jsonl data, for
``lm_eval --include_path DIR --tasks raylm_val_ppl,raylm_val_cloze`` (no network: the data are local files):

- ``raylm_val_ppl`` (``loglikelihood_rolling``: word/byte perplexity, bits per byte) over exactly the items of the
  canary's eval set (``serve.evalset.build_evalset``, the val split's documents), so the canary's score and the
  harness's log-likelihoods are of the same texts and can be checked against each other.
- ``raylm_val_cloze`` (``multiple_choice``: acc, acc_norm): for each val document, its opening words as the
  context and four continuations: its own next words and the same stretch of three other val documents.

Both backends see the same tasks: ``--model local-completions`` against the live endpoint (loglikelihood needs
``echo`` + ``logprobs``) and ``--model hf`` against ``python -m train.export --format hf``; the commands are in
serve/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from ground.storage import join
from serve.evalset import DataDir, EvalSetError, build_evalset

PPL_TASK = "raylm_val_ppl"
CLOZE_TASK = "raylm_val_cloze"
CONTEXT_WORDS = 24  # the cloze context: long enough to carry a topic, short enough for a 128-token model
CHOICE_WORDS = 8  # each continuation: distinct enough between documents, short enough to stay in context
CHOICES = 4


def cloze_items(texts: list[str], seed: int = 0) -> list[dict]:
    """One 4-way item per text with at least CONTEXT_WORDS + CHOICE_WORDS words; distractors are the same word
    span of other texts, picked with a seeded RNG so a rebuild gives the same items."""
    spans = []
    for text in texts:
        words = text.split()
        if len(words) >= CONTEXT_WORDS + CHOICE_WORDS:
            spans.append(
                (" ".join(words[:CONTEXT_WORDS]), " " + " ".join(words[CONTEXT_WORDS : CONTEXT_WORDS + CHOICE_WORDS]))
            )
    if len(spans) < CHOICES:
        raise EvalSetError(f"need {CHOICES}+ val documents of {CONTEXT_WORDS + CHOICE_WORDS}+ words, got {len(spans)}")
    rng = random.Random(seed)
    items = []
    for i, (context, answer) in enumerate(spans):
        others = rng.sample([j for j in range(len(spans)) if j != i], CHOICES - 1)
        choices = [answer, *(spans[j][1] for j in others)]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return items


def task_yaml(name: str, data_file: Path, **fields: object) -> dict:
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file.resolve())}},
        "test_split": "test",
        **fields,
        "metadata": {"version": 1.0},
    }


def relocated_task_yaml(path: Path, data_dir: str) -> str:
    """The task YAML at ``path`` with its data file named under ``data_dir`` (a directory, or a URI named as it is)
    instead of where it was built: what a stage stores beside the jsonl it uploads, so that stored tasks in a local
    directory run from there (``lm_eval --include_path DIR``)."""
    task = yaml.safe_load(path.read_text())
    files = task["dataset_kwargs"]["data_files"]
    task["dataset_kwargs"]["data_files"] = {split: join(data_dir, Path(file).name) for split, file in files.items()}
    return yaml.safe_dump(task, sort_keys=False)


def build_tasks(
    data_dirs: DataDir | Sequence[DataDir], output: str | Path, items: int = 16, max_tokens: int | None = None
) -> Path:
    """Write both tasks' YAML and jsonl into ``output``, plus the canary eval set of the same items
    (``canary-evalset.jsonl``, from one data dir's val documents or a mixture's in turn: ``build_evalset``);
    returns ``output`` (the ``--include_path``). ``max_tokens``: cut each text to
    that many tokens (the model's block size - 2 keeps an item, its leading end-of-text token and the one token
    the harness's completions backend asks for inside one context window, so every backend scores it alike)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    evalset = build_evalset(data_dirs, out / "canary-evalset.jsonl", items=items, max_tokens=max_tokens)
    texts = [item.text for item in evalset.items]
    ppl_data = out / f"{PPL_TASK}.jsonl"
    ppl_data.write_text("".join(json.dumps({"id": i.id, "text": i.text}) + "\n" for i in evalset.items))
    cloze_data = out / f"{CLOZE_TASK}.jsonl"
    cloze_data.write_text("".join(json.dumps(item) + "\n" for item in cloze_items(texts)))
    ppl = task_yaml(
        PPL_TASK, ppl_data,
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        should_decontaminate=False,
        # The harness's own aggregations for these metrics, spelled out so that it does not warn about each one.
        metric_list=[
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
    )  # fmt: skip
    cloze = task_yaml(
        CLOZE_TASK, cloze_data,
        output_type="multiple_choice",
        doc_to_text="{{context}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{label}}",
        target_delimiter="",  # each choice starts with its own space, as the words did in the text
        metric_list=[
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    )  # fmt: skip
    for name, task in ((PPL_TASK, ppl), (CLOZE_TASK, cloze)):
        (out / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve.harness_tasks",
        description="Write lm-evaluation-harness tasks (YAML + local jsonl) over a pipeline output's val documents: "
        f"{PPL_TASK} (perplexity on the canary's items) and {CLOZE_TASK} (4-way continuation choice).",
    )
    parser.add_argument("--data", required=True, help="pipeline output dir (has documents/val-*.parquet)")
    parser.add_argument("--output", required=True, help="task dir to write (lm_eval --include_path)")
    parser.add_argument("--items", type=int, default=16, help="val documents to use (default: 16, the canary's)")
    parser.add_argument(
        "--max-tokens", type=int, help="cut each text to this many tokens: the model's block size - 2 makes every "
        "backend score it in one window (default: no cut)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        out = build_tasks(args.data, args.output, args.items, args.max_tokens)
    except EvalSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tasks {PPL_TASK}, {CLOZE_TASK} in {out} (lm_eval --include_path {out} --tasks {PPL_TASK},{CLOZE_TASK})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
