"""Pipeline benchmark: ``python -m pipeline run`` against a read-only floor and datatrove on the same files, the
driver's peak memory at 1x and 8x input, and MinHash-LSH precision/recall on planted near-duplicates.

    .venv/bin/python bench/pipeline_bench.py            # 200 MB of Debian-docs WARC, 3 rounds (long on 2 cores)
    .venv/bin/python bench/pipeline_bench.py --quick    # 24 MB, 2 rounds, RSS at 2/16 MB, 150 planted docs
    .venv/bin/python bench/pipeline_bench.py --wet      # the same pages' text as 200 MB of WET (conversion records)
    .venv/bin/python bench/pipeline_bench.py --smoke    # data/sample, 1 round, every section once (~70 s, no apt)

Everything printed is measured in this run; the report is one markdown document on stdout (progress and library
logs go to stderr or to log files in the work dir). A benchmark, not a test: it asserts nothing about speed.

Sections (each can be skipped with --skip):

floor      warcio ``ArchiveIterator`` reading every record's content (decompress + parse) over the same files with
           the same number of processes (a process pool, one file per task).
ours       ``python -m pipeline run --num-cpus W`` in a subprocess, timed from process start to exit: interpreter,
           imports, ``ray.init``, model loading and ``ray.shutdown`` are inside the wall. The stage seconds and
           counts come from its ``report.json``; its driver's peak RSS from ``getrusage`` in that process.
datatrove  datatrove 0.10 in a subprocess, also timed from process start: WarcReader -> LanguageFilter ->
           Gopher/C4/FineWeb filters -> JsonlWriter -> MinhashDedupSignature (tasks = workers = W, so each worker
           loads spaCy and fastText about once), MinhashDedupBuckets, MinhashDedupCluster, then JsonlReader ->
           MinhashDedupFilter -> DocumentTokenizer (tasks = W).
rss        how a ``python -m pipeline run`` grows from 1x to 8x input: wall, stage worker-seconds, the driver's peak RSS
           (getrusage in that process) and each dedup index shard's peak RSS (its actor process, sampled by psutil).
minhash    ``deduplicate()`` with exact dedup off on a planted set (real texts + edited variants, no exact copies,
           near-misses at Jaccard 0.5-0.75 included) for ``minhash.verify`` = none / signature / jaccard, against
           the exact Jaccard of the word n-gram sets of every pair: set and scores from ``pipeline.dedup_eval``.

Rounds alternate the order of ours and datatrove (odd rounds run datatrove first); timings are reported as
median [IQR] over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's parts, beside this script

from pipeline_bench_common import (
    CACHE,
    CCNET_DIR,
    DEMO_CONFIG,
    SAMPLE_DIR,
    WARC_SUFFIXES,
    docs_into_dedup,
    fmt_spread,
    log,
    mb,
    stage_seconds,
)
from pipeline_bench_inputs import (
    debian_set,
    describe_debian,
    link_files,
    renumbered_copies,
    warc_files,
)
from pipeline_bench_minhash import PLANTED_SEED, band_label, base_texts, bench_minhash
from pipeline_bench_sides import (
    bands_rows,
    datatrove_job,
    datatrove_missing,
    floor_round,
    run_datatrove,
    run_ours,
)

# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def render(args, command: str, inp: dict, rounds: list[dict], rss: dict | None, mh: dict | None) -> str:
    w = args.workers
    size = mb(inp["bytes"])
    records = inp.get("records")
    out = [
        "",
        "## Pipeline benchmark",
        "",
        f"Input: {inp['files']} files, {size:,.1f} MB compressed"
        + (f", {records:,} WARC records" if records else "")
        + f": {inp['description']}.",
        f"Machine: {os.cpu_count()} CPUs visible. Each side gets {w} processes: Ray `--num-cpus {w}`; datatrove "
        f"workers = tasks = {w}; the floor a pool of {w}. {len(rounds)} round(s), ours and datatrove alternating "
        "in order (odd rounds run datatrove first). Timings: median [IQR] over rounds.",
        "",
    ]

    floor = [r["floor"] for r in rounds if r.get("floor")]
    ours = [r["ours"] for r in rounds if r.get("ours")]
    dts = [r["datatrove"] for r in rounds if r.get("datatrove") and "skipped" not in r["datatrove"]]
    dt_skip = next(
        (r["datatrove"]["skipped"] for r in rounds if r.get("datatrove") and "skipped" in r["datatrove"]), None
    )
    floor_mbs = statistics.median(size / f["wall_s"] for f in floor) if floor else None

    def row(label: str, what: str, walls: list[float], kept: str, tokens: str) -> str:
        mbs = [size / x for x in walls]
        rps = [records / x for x in walls] if records else []
        vs = fmt_spread([m / floor_mbs for m in mbs], 3, "x") if floor_mbs else "n/a"
        return (
            f"| {label} | {what} | {fmt_spread(walls)} | {fmt_spread(mbs, 3)} | {fmt_spread(rps, 0)} | {kept} | "
            f"{tokens} | {vs} |"
        )

    out += [
        "### Throughput (start-up included)",
        "",
        "| system | what runs | wall s | input MB/s | records/s | kept docs | tokens | vs floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    if floor:
        out.append(
            row(
                f"read-only floor, {w} procs",
                "warcio decompress + parse, every record's content",
                [f["wall_s"] for f in floor],
                "-",
                "-",
            )
        )
    if ours:
        rep = ours[0]["report"]
        stages = " > ".join(s["name"] for s in rep["stages"])
        out.append(
            row(
                "**ours**",
                f"`python -m pipeline run` process: start-up, {stages}, BPE training, writing",
                [o["wall_s"] for o in ours],
                f"{rep['output']['docs']:,}",
                f"{rep['output']['tokens']:,}",
            )
        )
        out.append(
            row(
                "ours, report.json wall",
                "same run, its own wall (no interpreter / ray.init / shutdown)",
                [o["report"]["throughput"]["wall_seconds"] for o in ours],
                "",
                "",
            )
        )
    if dts:
        import importlib.metadata as md

        out.append(
            row(
                f"**datatrove** {md.version('datatrove')}",
                "process: " + " > ".join(dts[0]["stages"]),
                [d["wall_s"] for d in dts],
                f"{dts[0]['kept']:,}",
                f"{dts[0]['tokens']:,}",
            )
        )
    elif dt_skip:
        out.append(f"| datatrove | SKIPPED: {dt_skip} | | | | | | |")
    out.append("")

    paired = [r for r in rounds if r.get("ours") and r.get("datatrove") and "skipped" not in r["datatrove"]]
    if paired:
        out.append(
            "- **ours / datatrove** (input MB/s, per-round ratio of back-to-back runs): "
            + fmt_spread([r["datatrove"]["wall_s"] / r["ours"]["wall_s"] for r in paired], 2, "x")
        )
    if ours and floor:
        out.append(
            "- **ours / floor** (input MB/s, per round): "
            + fmt_spread(
                [r["floor"]["wall_s"] / r["ours"]["wall_s"] for r in rounds if r.get("ours") and r.get("floor")], 3, "x"
            )
            + f"; floor {fmt_spread([size / f['wall_s'] for f in floor], 1)} MB/s"
        )
    if ours:
        stage_s = [stage_seconds(o["report"]) for o in ours]
        eff = [s / (o["wall_s"] * w) for s, o in zip(stage_s, ours, strict=True)]
        eff_rep = [s / (o["report"]["throughput"]["wall_seconds"] * w) for s, o in zip(stage_s, ours, strict=True)]
        startup = [o["wall_s"] - o["report"]["throughput"]["wall_seconds"] for o in ours]
        out += [
            f"- **parallel efficiency** (sum of stage worker-seconds / (wall x {w})): "
            f"{fmt_spread([e * 100 for e in eff], 0, '%')} of the process wall, "
            f"{fmt_spread([e * 100 for e in eff_rep], 0, '%')} of report.json's wall; stage worker-seconds "
            f"{fmt_spread(stage_s, 1)} s",
            f"- ours outside report.json's wall (interpreter, imports, ray.init, shutdown): {fmt_spread(startup, 1)} s",
            f"- driver peak RSS of these runs: {fmt_spread([o['maxrss_kb'] / 1024 for o in ours], 0)} MiB",
        ]
        out += [
            "",
            "### Ours per stage (report.json; seconds = summed worker seconds)",
            "",
            "| stage | docs in | docs out | worker s | ms/doc in | share of stage s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for i, s in enumerate(ours[0]["report"]["stages"]):
            secs = [o["report"]["stages"][i]["seconds"] for o in ours]
            per_doc = [1000 * x / s["docs_in"] for x in secs] if s["docs_in"] else []
            share = [o["report"]["stages"][i]["seconds"] / t * 100 for o, t in zip(ours, stage_s, strict=True) if t]
            out.append(
                f"| {s['name']} | {s['docs_in']:,} | {s['docs_out']:,} | {fmt_spread(secs, 1)} | "
                f"{fmt_spread(per_doc, 2)} | {fmt_spread(share, 0, '%')} |"
            )
        reasons: dict[str, int] = {}
        for s in ours[0]["report"]["stages"]:
            for k, v in s.get("reasons", {}).items():
                reasons[k] = reasons.get(k, 0) + v
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:8]
        out += ["", "Top drop reasons (ours): " + ", ".join(f"{k} {v:,}" for k, v in top)]
    if dts:
        names = list(dts[0]["seconds"])
        out += [
            "",
            "datatrove per executor run (wall s): "
            + ", ".join(f"{n} {fmt_spread([d['seconds'][n] for d in dts], 1)}" for n in names)
            + f"; docs read {dts[0]['read_docs']:,}, after filters {dts[0]['after_filters']:,}, after MinHash "
            f"{dts[0]['kept']:,}.",
        ]
        out += [f"- {n}" for n in dts[0]["notes"]]

    if rss is not None:
        k = rss["factor"]
        out += [
            "",
            f"### Driver peak RSS, 1x vs {k}x input, and how the rest grows (`python -m pipeline run`)",
            "",
            "| input | files | MB | records in | docs into dedup | run wall s | stage worker-s | driver peak RSS MiB "
            "| index shards | largest shard peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for label, r in (("1x", rss["1x"]), (f"{k}x", rss["kx"])):
            rep, peaks = r["report"], r["shard_peak_rss"]
            # --smoke's 1x run is the throughput run, which does not sample the shards (it is timed).
            shards = f"{len(peaks)} | {max(peaks) / 2**20:,.0f}" if peaks else "- | - (not sampled)"
            out.append(
                f"| {label}: {r['label']} | {r['files']} | {mb(r['bytes']):,.1f} | {rep['input']['records']:,} | "
                f"{docs_into_dedup(rep):,} | {r['wall_s']:.1f} | {stage_seconds(rep):.1f} | "
                f"{r['maxrss_kb'] / 1024:,.0f} | {shards} |"
            )
        small, big = rss["1x"], rss["kx"]
        ratio = big["maxrss_kb"] / small["maxrss_kb"]
        out += ["", f"**Driver peak RSS {k}x / 1x: {ratio:.2f}** (target <= 1.3). {rss['note']}"]
        ratios = [
            ("run wall", big["wall_s"] / small["wall_s"]),
            ("stage worker-seconds", stage_seconds(big["report"]) / stage_seconds(small["report"])),
        ]
        if small["shard_peak_rss"] and big["shard_peak_rss"]:
            ratios.append(("largest index shard's peak RSS", max(big["shard_peak_rss"]) / max(small["shard_peak_rss"])))
        out.append(f"{k}x / 1x: " + "; ".join(f"{name} {value:.2f}" for name, value in ratios) + ".")

    if mh is not None:
        from pipeline.dedup_eval import EDIT_RATES

        t = mh["threshold"]
        out += [
            "",
            "### MinHash-LSH on planted near-duplicates (exact dedup off, MinHash only)",
            "",
            f"{mh['docs']} docs from {mh['bases']} real bases (cc_net text, then kept documents of our first run; "
            f"<= 400 words each) and their variants at per-word edit rates "
            f"{', '.join(str(x) for x in EDIT_RATES)} (`pipeline.dedup_eval.planted_set`, seed {PLANTED_SEED}: "
            f"no exact copies after normalisation). {mh['pairs']:,} pairs, {mh['truth']} true pairs (exact "
            f"Jaccard of word {mh['ngram']}-gram sets >= {t}), {mh['near_miss']} near-miss pairs at J in "
            f"[0.5, 0.75), min true J {'n/a' if mh['min_true_j'] is None else round(mh['min_true_j'], 3)}. "
            f"Exact all-pairs Jaccard (for the band breakdown) took {mh['exact_s']:.1f} s.",
            "",
        ]
        if mh["missing_verify"]:
            out += [
                "verify variants SKIPPED: needs `minhash.verify` in `pipeline.steps.dedup.MinHashDedupConfig`, "
                "which this checkout does not have.",
                "",
            ]
        out += [
            "| verify | bands x rows | dedup s | + vs none | dropped | precision (drops) | recall (pairs "
            "collapsed) | same-cluster precision | same-cluster recall |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = mh["seconds"].get("none")
        for name in mh["variants"]:
            r = mh["results"][name]
            secs = mh["seconds"][name]
            extra = (
                fmt_spread([s - b for s, b in zip(secs, base, strict=True)], 3, " s")
                if base and name != "none"
                else "-"
            )
            b, rw = r["bands_rows"]
            # Counts back from pair_metrics' ratios (exact: ratio x denominator of small integers).
            correct, collapsed = round(r["precision"] * r["dropped"]), round(r["recall"] * r["true_pairs"])
            same_tp = round(r["cluster_recall"] * r["true_pairs"])
            out.append(
                f"| {name} | {b} x {rw} | {fmt_spread(secs, 3)} | {extra} | {r['dropped']} | "
                f"{r['precision']:.3f} ({correct}/{r['dropped']}) | "
                f"{r['recall']:.3f} ({collapsed}/{r['true_pairs']}) | "
                f"{r['cluster_precision']:.3f} | {r['cluster_recall']:.3f} ({same_tp}/{r['true_pairs']}) |"
            )
        bands = [tuple(b) for b in mh["bands"]]
        true_bands = [i for i, (lo, _) in enumerate(bands) if lo >= t]
        out += [
            "",
            "By exact Jaccard band: drops = dropped docs whose J with their `duplicate_of` is in the band "
            f"(below {t}: wrong drops); collapsed = true pairs in the band of which at least one doc was dropped:",
            "",
            "| verify | "
            + " | ".join(f"drops, {band_label(*b)}" for b in bands)
            + " | "
            + " | ".join(f"collapsed, {band_label(*bands[i])}" for i in true_bands)
            + " |",
            "|---|" + "---:|" * (len(bands) + len(true_bands)),
        ]
        for name in mh["variants"]:
            r = mh["results"][name]
            drops = " | ".join(str(d) for d in r["drops_by_band"])
            coll = " | ".join("{}/{}".format(*r["collapsed_by_band"][i]) for i in true_bands)
            out.append(f"| {name} | {drops} | {coll} |")
        out += [
            "",
            "Pairs per band (sharing >= 1 n-gram): "
            + ", ".join(f"{band_label(*b)} {n:,}" for b, n in zip(bands, mh["band_pairs"], strict=True))
            + ".",
        ]
        out += [
            "",
            "Scored by `pipeline.dedup_eval.pair_metrics`. Precision (drops) = dropped docs whose exact "
            "Jaccard with their `duplicate_of` is >= the threshold / dropped docs; recall (pairs collapsed) = "
            "true pairs of which at least one doc was dropped / true pairs. Same-cluster: a doc joined to its "
            "`duplicate_of` (transitively) forms a cluster; precision = true pairs among same-cluster pairs / "
            "same-cluster pairs, recall = same-cluster true pairs / true pairs (transitive chains count against "
            "precision here even when each drop is right). dedup s = `deduplicate()` wall in this process; "
            "+ vs none = per-round difference to verify=none (the time verification adds).",
        ]
    out += ["", "Command:", "", "```", command, "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="shorter: --mb 24, --rounds 2, --rss-mb 2, --planted 150")
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="every section once on a tiny input: data/sample or --warc-dir (no apt, no download), "
        "1 round, RSS at that input x1 (the throughput run) vs x2, 60 planted docs",
    )
    parser.add_argument(
        "--mb",
        type=float,
        help="size of the Debian-docs input in MB of .warc.gz (.warc.wet.gz with --wet; default 200)",
    )
    parser.add_argument("--files", type=int, help="files in the Debian-docs WARC input (default: one per ~6 MB)")
    parser.add_argument(
        "--wet",
        action="store_true",
        help="the Debian-docs input as WET (each page's extracted text, --mb MB of .warc.wet.gz) instead of WARC",
    )
    parser.add_argument(
        "--warc-dir", type=Path, help="use this directory of WARC/WET files as the input instead of the Debian set"
    )
    parser.add_argument("--with-sample", action="store_true", help="add data/sample (6 files, 0.65 MB) to the input")
    parser.add_argument(
        "--deb-cache",
        type=Path,
        default=CACHE / "debs",
        help="cache of downloaded .deb files (default bench/.cache/debs)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="processes per side: Ray --num-cpus, datatrove workers and tasks, floor pool (default 2)",
    )
    parser.add_argument("--rounds", type=int, help="throughput rounds, order alternated (default 3)")
    parser.add_argument(
        "--rss-mb",
        type=float,
        help="1x input of the RSS section in MB (default 8; the 8x input is --rss-factor times it)",
    )
    parser.add_argument("--rss-factor", type=int, default=None, help="the larger RSS input, x 1x (default 8)")
    parser.add_argument("--planted", type=int, help="planted docs for the MinHash section (default 300)")
    parser.add_argument("--threshold", type=float, default=0.8, help="MinHash Jaccard threshold (default 0.8)")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEMO_CONFIG,
        help="pipeline config for our runs (default pipeline/configs/demo.yaml)",
    )
    parser.add_argument(
        "--ccnet-dir",
        type=Path,
        default=CCNET_DIR,
        help="cc_net jsonl.gz texts for the planted set's bases",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["floor", "ours", "datatrove", "rss", "minhash"],
        help="skip a section (repeatable)",
    )
    parser.add_argument("--workdir", type=Path, help="keep outputs and logs here (default: a temp dir, deleted)")
    parser.add_argument("--json", type=Path, help="also write every measured number (all rounds) here")
    parser.add_argument("--datatrove-job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        preset = {"rounds": 1, "rss_factor": 2, "planted": 60}
    elif args.quick:
        preset = {"mb": 24.0, "rounds": 2, "rss_mb": 2.0, "rss_factor": 8, "planted": 150}
    else:
        preset = {"mb": 200.0, "rounds": 3, "rss_mb": 8.0, "rss_factor": 8, "planted": 300}
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.mb = args.mb if args.mb is not None else 200.0
    args.rss_mb = args.rss_mb if args.rss_mb is not None else 8.0
    if args.workers < 1 or args.rounds < 1:
        parser.error("--workers and --rounds must be >= 1")
    if args.wet and (args.warc_dir or args.smoke):
        # --wet picks the Debian set's format; --warc-dir files and --smoke's data/sample are read as they are.
        parser.error(
            f"--wet builds the Debian set as WET; it does not apply with {'--warc-dir' if args.warc_dir else '--smoke'}"
        )
    return args


def build_input(args, work: Path) -> tuple[Path, list[Path], str]:
    """The throughput input: one directory of links to the WARC/WET files (nothing else in it), and a description."""
    if args.warc_dir:
        src_files, desc = warc_files(args.warc_dir), str(args.warc_dir)
        if not src_files:
            raise SystemExit(f"{args.warc_dir}: no WARC/WET files ({', '.join(WARC_SUFFIXES)})")
    elif args.smoke:
        src_files, desc = warc_files(SAMPLE_DIR), "data/sample (WET + WARC; --smoke)"
    else:
        src_dir, meta = debian_set(args.mb, args.files, args.deb_cache, wet=args.wet)
        src_files, desc = warc_files(src_dir), describe_debian(meta)
    files = link_files(src_files, work / "input")
    if args.with_sample and not (args.smoke and not args.warc_dir):
        files += link_files(warc_files(SAMPLE_DIR), work / "input", prefix="sample-")
        desc += " + data/sample"
    return work / "input", files, desc


def rss_inputs(args, work: Path, tp_dir: Path, tp_files: list[Path]) -> tuple[dict, dict, str]:
    k = args.rss_factor
    if args.smoke:
        small = {"dir": tp_dir, "files": tp_files, "label": "the throughput input"}
        big_files = renumbered_copies(tp_files, k, work / "rss-kx")
        big = {
            "dir": work / "rss-kx",
            "files": big_files,
            "label": f"the throughput input x{k} (copies 2..{k}: fresh record ids, duplicate content)",
        }
        return small, big, "--smoke: the 1x run is the throughput run (no run of its own)."
    n_small = 4
    src_dir, _ = debian_set(args.rss_mb * k, n_small * k, args.deb_cache, wet=args.wet)
    all_files = warc_files(src_dir)
    small_files = link_files(all_files[:n_small], work / "rss-1x")
    small = {
        "dir": work / "rss-1x",
        "files": small_files,
        "label": f"{n_small} of the {len(all_files)} files of the {args.rss_mb * k:g} MB Debian set",
    }
    big_files = link_files(all_files, work / "rss-kx")
    big = {"dir": work / "rss-kx", "files": big_files, "label": f"all {len(all_files)} files of it"}
    note = (
        f"The RSS inputs ({mb(sum(f.stat().st_size for f in small_files)):.0f} and "
        f"{mb(sum(f.stat().st_size for f in all_files)):.0f} MB) are smaller than the throughput input; every "
        "file of the Debian set holds a similar mix of packages (records go to the smallest file), so 1x is a "
        f"1/{k} slice of the same content mix."
    )
    return small, big, note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.datatrove_job:
        spec = json.loads(args.datatrove_job.read_text())
        result = datatrove_job(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0
    command = " ".join(
        [
            ".venv/bin/python",
            "bench/pipeline_bench.py",
            *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        ]
    )
    tmp = None
    if args.workdir:
        work = args.workdir
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline-bench-")
        work = Path(tmp.name)
    logs = work / "logs"
    logs.mkdir()
    try:
        input_dir, files, description = build_input(args, work)
        for f in files:  # warm the page cache so the first contender is not charged for disk reads
            with open(f, "rb") as fh:
                while fh.read(1 << 22):
                    pass
        inp = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "description": description}
        log(f"input: {inp['files']} files, {mb(inp['bytes']):.1f} MB in {input_dir}")

        dt_skip = datatrove_missing() if "datatrove" not in args.skip else None
        br = bands_rows(args.config) if "datatrove" not in args.skip and not dt_skip else None
        tokenizer = work / "tokenizer.json"
        first_documents = work / "ours-documents"
        rounds: list[dict] = []
        for r in range(args.rounds):
            rec: dict = {}
            if "floor" not in args.skip:
                log(f"round {r + 1}/{args.rounds}: read-only floor")
                rec["floor"] = floor_round(files, args.workers)
                inp["records"] = rec["floor"]["records"]
            order = ["ours", "datatrove"] if r % 2 == 0 else ["datatrove", "ours"]
            for side in order:
                if side in args.skip:
                    continue
                if side == "ours":
                    log(f"round {r + 1}/{args.rounds}: ours (python -m pipeline run, {args.workers} CPUs)")
                    out_dir = work / f"ours-{r}"
                    rec["ours"] = run_ours(input_dir, out_dir, args.config, args.workers, logs / f"ours-{r}.log")
                    inp.setdefault("records", rec["ours"]["report"]["input"]["records"])
                    if not tokenizer.exists() and (out_dir / "tokenizer.json").is_file():
                        shutil.copyfile(out_dir / "tokenizer.json", tokenizer)
                    if not first_documents.exists() and (out_dir / "documents").is_dir():
                        shutil.copytree(out_dir / "documents", first_documents)
                    shutil.rmtree(out_dir, ignore_errors=True)
                elif dt_skip:
                    rec["datatrove"] = {"skipped": dt_skip}
                else:
                    log(f"round {r + 1}/{args.rounds}: datatrove ({args.workers} workers, {args.workers} tasks)")
                    dt_work = work / f"datatrove-{r}"
                    try:
                        rec["datatrove"] = run_datatrove(
                            input_dir,
                            dt_work,
                            args.workers,
                            tokenizer if tokenizer.exists() else None,
                            br,
                            logs / f"datatrove-{r}.log",
                        )
                    except Exception as err:  # report it, do not hide it: the table says datatrove failed
                        log(f"datatrove failed: {err}")
                        rec["datatrove"] = {
                            "skipped": f"failed: {str(err).splitlines()[0][:200]} (log: {logs / f'datatrove-{r}.log'})"
                        }
                        dt_skip = rec["datatrove"]["skipped"]
                    shutil.rmtree(dt_work, ignore_errors=True)
            rounds.append(rec)

        rss = None
        if "rss" not in args.skip:
            small, big, note = rss_inputs(args, work, input_dir, files)
            rss = {"factor": args.rss_factor, "note": note}
            for key, part in (("1x", small), ("kx", big)):
                reuse = args.smoke and key == "1x" and rounds and rounds[0].get("ours")
                if reuse:
                    res = rounds[0]["ours"]
                else:
                    log(f"RSS: {key} ({mb(sum(f.stat().st_size for f in part['files'])):.1f} MB)")
                    res = run_ours(
                        part["dir"],
                        work / f"rss-out-{key}",
                        args.config,
                        args.workers,
                        logs / f"rss-{key}.log",
                        sample_shards=True,
                    )
                    shutil.rmtree(work / f"rss-out-{key}", ignore_errors=True)
                rss[key] = {
                    **res,
                    "label": part["label"],
                    "files": len(part["files"]),
                    "bytes": sum(f.stat().st_size for f in part["files"]),
                }

        mh = None
        if "minhash" not in args.skip:
            log("MinHash quality")
            bases = base_texts(first_documents, args.ccnet_dir, n_bases=max(2, args.planted // 6))
            if len(bases) < 2:
                log("MinHash section skipped: fewer than 2 base texts")
            else:
                mh = bench_minhash(bases, args.planted, args.threshold, args.rounds)

        print(render(args, command, inp, rounds, rss, mh))
        if args.json:
            args.json.write_text(
                json.dumps({"input": inp, "rounds": rounds, "rss": rss, "minhash": mh}, indent=1, default=str)
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
