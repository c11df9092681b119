"""ONNX Runtime translation with the cores in one search or in several, side by side.

    python -m benchmarks.parallel_batches ONNX_DIR --src test.de.gz [--layouts 2x1 1x2]
    python -m benchmarks.parallel_batches ONNX_DIR --src test.de.gz --layouts 2x1:none 2x1 2x1:all
    python -m benchmarks.parallel_batches ONNX_DIR --src test.de.gz --layouts 1x2:own 1x2:shared
    python -m benchmarks.parallel_batches ONNX_DIR --src test.de.gz --layouts 2x1 2x1:whole

A layout `TxP` runs P batches at once (`translate(..., parallel_batches=P)`),
each search on T intra-op threads; `2x1` and `1x2` both use 2 cores. A
suffix sets which graphs' idle worker threads spin (`OnnxTranslator`'s
`spinning`): `:auto` (the default, the search graphs'), `:none` or `:all`;
`:shared` runs the P searches on one translator's sessions and `:own` on one
translator (and sessions) each, where `translate` gives beam searches their own
and greedy searches shared ones; `:whole` keeps each batch one search
(`split_batches=False`), where by default a batch with enough rows runs
as one search per thread (`OnnxTranslator`'s `split_batches`). For
each precision of the export and each cell (greedy and beam 4, batch 1 and
32), every layout translates the same sentences, repetitions interleaved,
and the median is kept. Reported: sentences/s, the speed relative to the
first layout, and how many outputs are the same as the first layout's.
Writes JSON to benchmarks/results/parallel_batches.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CELLS = (("greedy", 1, 1), ("greedy", 1, 32), ("beam 4", 4, 1), ("beam 4", 4, 32))


SPINNING = {"auto": None, "none": False, "all": True}


def layout(text):
    """ "TxP[:spinning][:shared|:own][:whole]" -> (name, threads, parallel_batches,
    spinning, sessions, split); T and P positive, sessions None, "shared" or "own",
    split None (the translator's choice) or False (":whole")."""
    cores, *suffixes = text.lower().split(":")
    whole = "whole" in suffixes
    suffixes = [part for part in suffixes if part != "whole"]
    sessions = [part for part in suffixes if part in ("shared", "own")]
    suffixes = [part for part in suffixes if part not in sessions]
    if len(sessions) > 1:
        raise argparse.ArgumentTypeError(f"shared or own sessions, not both; got {text!r}")
    if len(suffixes) > 1:
        raise argparse.ArgumentTypeError(f"one spinning policy at most; got {text!r}")
    policy = suffixes[0] if suffixes else ""
    try:
        threads, parallel = (int(part) for part in cores.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a layout is THREADSxBATCHES[:SPINNING], e.g. 2x1, 1x2 or 2x1:none; got {text!r}"
        ) from None
    if threads < 1 or parallel < 1:
        raise argparse.ArgumentTypeError(f"threads and batches must be positive; got {text!r}")
    if policy and policy not in SPINNING:
        raise argparse.ArgumentTypeError(
            f"spinning is one of {', '.join(SPINNING)}; got {policy!r} in {text!r}"
        )
    name = f"{threads}x{parallel}" + (f":{policy}" if policy and policy != "auto" else "")
    name += f":{sessions[0]}" if sessions else ""
    name += ":whole" if whole else ""
    split = False if whole else None
    return name, threads, parallel, SPINNING[policy or "auto"], (sessions or [None])[0], split


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel_batches")
    parser.add_argument("onnx_dir", help="a folder written by `keras-transformer export`")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--lines", type=int, default=200, help="first N sentences (default 200)")
    parser.add_argument(
        "--layouts",
        type=layout,
        nargs="+",
        default=[layout("2x1"), layout("1x2")],
        help="THREADSxBATCHES[:SPINNING][:shared|:own][:whole] each: intra-op threads per "
        "search x batches at once, whose worker threads spin: auto (the search graphs'), "
        "none or all, the batches on one translator's sessions or on their own, and each "
        "batch kept one search (whole) rather than one per thread (default: 2x1 1x2)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    parser.add_argument(
        "--out", default=os.path.join("benchmarks", "results", "parallel_batches.json")
    )
    return parser


def run(args):
    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.machine import write_report
    from keras_transformer.data.pipeline import read_lines

    lines = read_lines(args.src)[: args.lines]
    with open(os.path.join(args.onnx_dir, "manifest.json"), encoding="utf-8") as f:
        precisions = [p for p in json.load(f)["precisions"] if p in ("float32", "int8")]
    names = [name for name, *_ in args.layouts]
    if len(set(names)) != len(names):
        raise SystemExit(f"--layouts names a layout twice: {' '.join(names)}")
    results = []
    for precision in precisions:
        translators = {}
        for name, threads, parallel, spinning, sessions, split in args.layouts:
            translator = OnnxTranslator(
                args.onnx_dir,
                providers=["CPUExecutionProvider"],
                num_threads=threads,
                precision=precision,
                spinning=spinning,
                split_batches=split,
            )
            translator._parallel_sessions = sessions  # None: translate's own choice
            translators[name] = translator, parallel
        for label, beam, batch in CELLS:
            times = {name: [] for name in names}
            outputs = {}
            for _ in range(args.repeats):
                for name, (translator, parallel) in translators.items():
                    start = time.perf_counter()
                    outputs[name] = translator.translate(
                        lines, beam_size=beam, batch_size=batch, parallel_batches=parallel
                    )
                    times[name].append(time.perf_counter() - start)
            speed = {name: len(lines) / statistics.median(times[name]) for name in names}
            cell = {
                "precision": precision,
                "search": label,
                "batch_size": batch,
                "layouts": {
                    name: {
                        "sentences_per_second": speed[name],
                        "seconds": times[name],
                        "speedup": speed[name] / speed[names[0]],
                        "same_outputs": outputs[name] == outputs[names[0]],
                        "identical_lines": sum(
                            a == b for a, b in zip(outputs[name], outputs[names[0]], strict=True)
                        ),
                    }
                    for name in names
                },
            }
            results.append(cell)
            print(_row(cell), flush=True)
    report = write_report("parallel_batches", args, sentences=len(lines), cells=results)
    return report


def _row(cell):
    parts = [f"{cell['precision']}, {cell['search']}, batch {cell['batch_size']}:"]
    for name, entry in cell["layouts"].items():
        same = "" if entry["same_outputs"] else f", {entry['identical_lines']} identical"
        parts.append(
            f"{name} {entry['sentences_per_second']:.1f}/s ({entry['speedup']:.2f}x{same})"
        )
    return " ".join(parts)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
