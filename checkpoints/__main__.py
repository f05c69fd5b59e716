"""python -m checkpoints inspect|verify PATH: what a checkpoint holds, and whether it is intact.

PATH is one checkpoint dir (``<run>/checkpoint_step_000000100``) or a run dir (then every checkpoint
in it, newest first), local or in object storage (``s3://bucket/prefix/<run>``, as ``checkpoint.storage``
puts them). ``verify`` exits 1 when any checkpoint fails, naming the corrupt file; a remote checkpoint is
hashed as it streams in. ``inspect`` of a remote one fetches only its manifest and DCP's ``.metadata``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from checkpoints.manifest import MANIFEST_FILE, CorruptCheckpoint, checkpoint_names, read_manifest, verify
from ground.storage import filesystem, is_file, is_remote, join


def _targets(path: str) -> list[str]:
    fs, root = filesystem(path)
    if any(is_file(fs, join(root, name)) for name in (MANIFEST_FILE, ".metadata")):
        return [path]
    return [join(path, name) for name in checkpoint_names(path)]


@contextlib.contextmanager
def _readable_here(target: str) -> Iterator[Path]:
    """``target`` as a local dir holding what ``describe`` reads: itself, or for a URI a temporary copy of its
    manifest and DCP's ``.metadata`` (the shards, nearly all of the bytes, stay where they are)."""
    if not is_remote(target):
        yield Path(target)
        return
    fs, root = filesystem(target)
    with tempfile.TemporaryDirectory(prefix="raylm-inspect-") as tmp:
        for name in (MANIFEST_FILE, ".metadata"):
            if is_file(fs, join(root, name)):
                with fs.open_input_stream(join(root, name)) as src:
                    (Path(tmp) / name).write_bytes(src.read())
        yield Path(tmp)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def inspect(path: str, as_json: bool) -> dict[str, Any]:
    from checkpoints.checkpointer import describe  # imports torch: only when needed

    with _readable_here(path) as local:
        info = describe(local)
    if as_json:
        return info
    m = info["manifest"]
    print(f"{path}")
    if not m:
        print("  no manifest (checkpoint.json): an incomplete save")
    else:
        kinds = ",".join(m.get("kinds", []))
        print(f"  step {m['step']}  kinds {kinds}  world size {m['world_size']}  strategy {m.get('strategy')}")
        print(f"  tokens seen {m.get('tokens_seen')}  data step {m.get('data_step')}  val_loss {m.get('val_loss')}")
        print(f"  lineage: parent {m.get('parent')}  data manifest sha256 {m.get('data_manifest_sha256')}")
        # The model a resume must build to load it (train.resume_check refuses another).
        model = (m.get("train_config") or {}).get("model") or {}
        if model:
            print("  model: " + "  ".join(f"{key}={value}" for key, value in model.items()))
        print("  files:")
        for name, f in sorted(m.get("files", {}).items()):
            print(f"    {name:<20} {_human(f['bytes']):>10}  sha256 {f['sha256']}")
    print("  entries:")
    for e in info["entries"]:
        shape = "x".join(map(str, e["shape"])) if e["shape"] is not None else "-"
        print(f"    {e['key']:<60} {e['dtype']:<8} {shape:<14} {_human(e['bytes']):>10}  shards {e['shards']}")
    total = sum(e["bytes"] or 0 for e in info["entries"])
    print(f"  {len(info['entries'])} entries, {_human(total)} of tensors")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints",
        description="Inspect or verify DCP checkpoints written by `python -m train` "
        "(a checkpoint dir, or a run dir for all of its checkpoints).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="step, world size, lineage, files with sha256, tensors with sizes")
    p_inspect.add_argument("path", help="checkpoint dir or run dir: a local path or a URI (s3://…)")
    p_inspect.add_argument("--json", action="store_true", help="machine-readable output")
    p_verify = sub.add_parser(
        "verify", help="check every file's size and sha256 against the manifest; exit 1 naming the corrupt file"
    )
    p_verify.add_argument("path", help="checkpoint dir or run dir: a local path or a URI (s3://…)")
    args = parser.parse_args(argv)

    try:
        targets = _targets(args.path)
    except (OSError, ValueError) as exc:  # unreachable storage, missing bucket or credentials; unknown URI scheme
        print(f"error: cannot read {args.path}: {exc}", file=sys.stderr)
        return 2
    if not targets:
        print(f"error: no checkpoint at {args.path}", file=sys.stderr)
        return 2
    if args.command == "inspect":
        infos = [inspect(t, args.json) for t in targets]
        if args.json:
            print(json.dumps(infos if len(infos) > 1 else infos[0], indent=2))
        return 0
    failed = 0
    # Hashing a large checkpoint (terabytes with optimizer state, over the network for a URI) takes a while: a
    # bar per checkpoint, on stderr, drawn only on a terminal.
    stderr = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as progress:
        for target in targets:
            try:
                files = read_manifest(target).get("files") or {}
                task = progress.add_task(target.rsplit("/", 1)[-1], total=sum(f["bytes"] for f in files.values()))
                manifest = verify(target, on_bytes=functools.partial(progress.advance, task))
            except CorruptCheckpoint as exc:
                failed += 1
                # Plain print: rich would wrap the line at its console width; the live display passes it through.
                print(f"FAIL {target}: {exc.reason} (file: {exc.file})", file=sys.stderr)
            else:
                print(f"OK   {target}: step {manifest['step']}, {len(manifest['files'])} files verified")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
