"""A search with its loop inside ONNX Runtime against the loop in Python, side by side.

    python -m benchmarks.search_loop ONNX_DIR --src test.de.gz [--beam-size 4]
        [--batch-sizes 1 2 4 8 16 32]

For each precision of the export and each batch size, the same sentences
(sorted by length into batches, as `translate` makes them) are searched
greedily (`--beam-size 1`, the default) with `greedy_search.onnx`, or with
beams with `beam_search.onnx`, one call per batch, and step by step over
`decoder_step.onnx` from Python (which leaves finished sentences out of the
decoder's batch), repetitions interleaved, on one intra-op thread; the
median is kept. Reported: sentences/s of each, their ratio, and the sentences
whose tokens are the same (all of them in float32; in int8 a sentence's
activations are quantized with its batch's, and the two loops hold different
batches once some sentences have finished). This is what
`GRAPH_LOOP_MAX_SENTENCES` and `BEAM_GRAPH_MAX_SENTENCES` in
`keras_transformer_runtime/runtime.py` are chosen on. Writes JSON to
benchmarks/results/search_loop.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.search_loop")
    parser.add_argument("onnx_dir", help="a folder written by `keras-transformer export`")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--lines", type=int, default=200, help="first N sentences (default 200)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument(
        "--beam-size", type=int, default=1, help="1: greedy search (default); more: beam search"
    )
    parser.add_argument(
        "--length-penalty", type=float, default=0.6, help="the beam search's alpha (default 0.6)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "search_loop.json"))
    return parser


def run(args):
    import numpy as np
    from keras_transformer_runtime import OnnxTranslator, runtime

    from benchmarks.machine import write_report
    from keras_transformer.data.pipeline import read_lines

    lines = read_lines(args.src)[: args.lines]
    with open(os.path.join(args.onnx_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    if args.beam_size < 1:
        raise SystemExit(f"--beam-size must be at least 1, not {args.beam_size}.")
    greedy = args.beam_size == 1
    graph, threshold = (
        ("greedy_search", "GRAPH_LOOP_MAX_SENTENCES")
        if greedy
        else ("beam_search", "BEAM_GRAPH_MAX_SENTENCES")
    )
    if graph not in manifest["graphs"]:
        raise SystemExit(f"{args.onnx_dir} has no {graph} graph: export it again.")
    precisions = [p for p in manifest["precisions"] if p in ("float32", "int8")]
    default = getattr(runtime, threshold)

    def search(translator, batch):
        if greedy:
            return translator.greedy_search(batch)[0]
        return translator.beam_search(
            batch, beam_size=args.beam_size, length_penalty=args.length_penalty
        )[0]

    results = []
    try:
        for precision in precisions:
            translator = OnnxTranslator(
                args.onnx_dir,
                providers=["CPUExecutionProvider"],
                num_threads=1,
                precision=precision,
            )
            sources = [translator.tokenizer.encode(line) + [2] for line in lines]
            order = np.argsort([len(s) for s in sources], kind="stable")
            for size in args.batch_sizes:
                batches = [
                    [sources[i] for i in order[start : start + size]]
                    for start in range(0, len(order), size)
                ]
                times = {"graph": [], "python": []}
                outputs = {}
                for _ in range(args.repeats):
                    for name, limit in (("graph", size), ("python", 0)):
                        setattr(runtime, threshold, limit)
                        start = time.perf_counter()
                        outputs[name] = [search(translator, b) for b in batches]
                        times[name].append(time.perf_counter() - start)
                speed = {k: len(lines) / statistics.median(v) for k, v in times.items()}
                cell = {
                    "precision": precision,
                    "beam_size": args.beam_size,
                    "batch_size": size,
                    "graph_sentences_per_second": speed["graph"],
                    "python_sentences_per_second": speed["python"],
                    "ratio": speed["graph"] / speed["python"],
                    "seconds": times,
                    "identical_sentences": sum(
                        a == b
                        for graph, python in zip(outputs["graph"], outputs["python"], strict=True)
                        for a, b in zip(graph, python, strict=True)
                    ),
                }
                results.append(cell)
                print(
                    f"{precision}, {'greedy' if greedy else f'beam {args.beam_size}'}, "
                    f"batch {size}: loop in the graph {speed['graph']:.1f}/s, "
                    f"in Python {speed['python']:.1f}/s ({cell['ratio']:.2f}x"
                    f", identical tokens on {cell['identical_sentences']} of {len(lines)})",
                    flush=True,
                )
    finally:
        setattr(runtime, threshold, default)
    report = write_report("search_loop", args, sentences=len(lines), cells=results)
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
