"""The beam search graphs with each row's best tokens found block by block or by one
`TopK`, side by side.

    python -m benchmarks.beam_selection ONNX_DIR --src test.de.gz [--beam 4]

Each decoder step of a beam search keeps each row's `2 x beam` best tokens.
`blocked_selection` (`keras_transformer/export/step_graph.py`) finds them from
the maxima of blocks of the vocabulary and one `TopK` over the best blocks
instead of one `TopK` over every log-probability. This builds `beam_search`
(one sentence per call) and `beam_batch_search` (batches of `--batch-size`)
both ways from the export's own decoder-step graph, for each of its
precisions (float32, int8), and runs the same first `--lines` sentences
(sorted by length) through each, repetitions interleaved, one intra-op
thread, idle threads not spinning; the best pass is kept.

Reported: sentences/s, the blocked graph's speed relative to the `TopK` one,
and the sentences whose tokens are the same both ways (all of them: the two
selections pick the same tokens). Writes JSON to
benchmarks/results/beam_selection.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.beam_selection")
    parser.add_argument("onnx_dir", help="a folder written by `keras-transformer export`")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--lines", type=int, default=96, help="first N sentences (default 96)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="for beam_batch_search")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved passes (default 5)")
    parser.add_argument(
        "--out", default=os.path.join("benchmarks", "results", "beam_selection.json")
    )
    return parser


def run(args):
    import numpy as np
    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.batch_steps import cpu_precisions, graph_sessions
    from benchmarks.machine import write_report
    from benchmarks.search_rows import _best, _search_feeds
    from keras_transformer.export.beam_graph import build_beam_batch_search, build_beam_search
    from keras_transformer.export.step_graph import selection_top_k_limit

    cells = []
    first = OnnxTranslator(args.onnx_dir, providers=["CPUExecutionProvider"], num_threads=1)
    limit = selection_top_k_limit(first.vocabulary_size)
    if limit is None or 2 * args.beam > limit:
        raise SystemExit(
            f"A vocabulary of {first.vocabulary_size} has no blocked selection for a beam of "
            f"{args.beam} (most top_k: {limit})."
        )
    graphs = {
        "beam_search": (build_beam_search, 1),
        "beam_batch_search": (build_beam_batch_search, args.batch_size),
    }
    for precision, translator, sources, step in cpu_precisions(args.onnx_dir, args.src, args.lines):
        for graph, (build, batch_size) in graphs.items():
            batches = [
                _search_feeds(translator, sources[i : i + batch_size], args.beam)
                for i in range(0, len(sources), batch_size)
            ]
            sessions = graph_sessions(
                args.onnx_dir,
                translator,
                {s: build(step, blocked=s == "blocked") for s in ("topk", "blocked")},
            )
            outputs = {
                name: [session.run(None, feeds) for feeds in batches]
                for name, session in sessions.items()
            }
            same = sum(
                int(np.array_equal(a[:n], b[:m]))
                for blocked, full in zip(outputs["blocked"], outputs["topk"], strict=True)
                for a, n, b, m in zip(blocked[0], blocked[1], full[0], full[1], strict=True)
            )

            def runner(session, batches=batches):
                return lambda: [session.run(None, feeds) for feeds in batches]

            best = _best({name: runner(s) for name, s in sessions.items()}, args.repeats)
            cell = {
                "precision": precision,
                "graph": graph,
                "beam_size": args.beam,
                "batch_size": batch_size,
                "sentences": len(sources),
                "sentences_per_second": {name: len(sources) / t for name, t in best.items()},
                "seconds": best,
                "speedup": best["topk"] / best["blocked"],
                "identical_sentences": same,
            }
            cells.append(cell)
            speed = cell["sentences_per_second"]
            print(
                f"{precision}, {graph}, batch {batch_size}: TopK {speed['topk']:.1f} / "
                f"blocked {speed['blocked']:.1f} sentences/s ({cell['speedup']:.3f}x), "
                f"{same}/{len(sources)} identical",
                flush=True,
            )
    return write_report("beam_selection", args, cells=cells)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
