"""Searches with their loop inside ONNX Runtime against the loop in Python, side by side.

    python -m benchmarks.search_loop ONNX_DIR --src test.de.gz [--beam-size 4]
        [--batch-sizes 1 2 4 8 16 32]

For each precision of the export and each batch size, the same sentences
(sorted by length into batches, as `translate` makes them) are searched
greedily (`--beam-size 1`, the default) or with beams, three ways, one call
per batch each, repetitions interleaved, on one intra-op thread; the median
is kept:

- `graph`: `greedy_search.onnx` / `beam_search.onnx`, whose loop computes a
  finished sentence's rows to the end;
- `batch_graph`: `greedy_batch_search.onnx` / `beam_batch_search.onnx`,
  whose loop drops each sentence when it ends (exports of format 5);
- `python`: step by step over `decoder_step.onnx` from Python, which also
  leaves finished sentences out of the decoder's batch.

Reported: sentences/s of each, each graph's ratio to Python, and the
sentences whose tokens are the same as Python's (all of them in float32; in
int8 a sentence's activations are quantized with its batch's, and the loops
hold different batches once some sentences have finished). This is what
`GRAPH_LOOP_MAX_SENTENCES`, `BEAM_GRAPH_MAX_SENTENCES` and the batch graphs'
switches in `keras_transformer_runtime/runtime.py` are chosen on. Writes JSON
to benchmarks/results/search_loop.json (or --out).
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
    graph, batch_graph = (
        ("greedy_search", "greedy_batch_search") if greedy else ("beam_search", "beam_batch_search")
    )
    if graph not in manifest["graphs"]:
        raise SystemExit(f"{args.onnx_dir} has no {graph} graph: export it again.")
    ways = ["graph"] + (["batch_graph"] if batch_graph in manifest["graphs"] else []) + ["python"]
    precisions = [p for p in manifest["precisions"] if p in ("float32", "int8")]
    switches = ("GRAPH_LOOP_MAX_SENTENCES", "BEAM_GRAPH_MAX_SENTENCES")
    switches += ("GREEDY_BATCH_GRAPH", "BEAM_BATCH_GRAPH")
    defaults = {name: getattr(runtime, name) for name in switches}

    def choose(way, size):
        """Sets the runtime's switches so that a batch of `size` takes `way`."""
        for name in switches[:2]:
            setattr(runtime, name, size if way == "graph" else 0)
        for name in switches[2:]:
            setattr(runtime, name, way == "batch_graph")

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
                times = {way: [] for way in ways}
                outputs = {}
                for _ in range(args.repeats):
                    for way in ways:
                        choose(way, size)
                        start = time.perf_counter()
                        outputs[way] = [search(translator, b) for b in batches]
                        times[way].append(time.perf_counter() - start)
                speed = {k: len(lines) / statistics.median(v) for k, v in times.items()}
                cell = {
                    "precision": precision,
                    "beam_size": args.beam_size,
                    "batch_size": size,
                    "python_sentences_per_second": speed["python"],
                    "seconds": times,
                }
                for way in ways[:-1]:
                    cell[f"{way}_sentences_per_second"] = speed[way]
                    cell[f"{way}_ratio"] = speed[way] / speed["python"]
                    cell[f"{way}_identical_sentences"] = sum(
                        a == b
                        for ours, python in zip(outputs[way], outputs["python"], strict=True)
                        for a, b in zip(ours, python, strict=True)
                    )
                results.append(cell)
                print(
                    f"{precision}, {'greedy' if greedy else f'beam {args.beam_size}'}, "
                    f"batch {size}: "
                    + ", ".join(
                        f"{way} {speed[way]:.1f}/s ({cell[f'{way}_ratio']:.2f}x Python, "
                        f"identical on {cell[f'{way}_identical_sentences']} of {len(lines)})"
                        for way in ways[:-1]
                    )
                    + f", Python {speed['python']:.1f}/s",
                    flush=True,
                )
    finally:
        for name, value in defaults.items():
            setattr(runtime, name, value)
    report = write_report("search_loop", args, sentences=len(lines), cells=results)
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
