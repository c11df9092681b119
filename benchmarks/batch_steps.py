"""Decoder steps per loop iteration of the greedy batch graph, side by side.

    python -m benchmarks.batch_steps ONNX_DIR --src test.de.gz [--batch-size 32]

`greedy_batch_search` drops the sentences that ended from its state by
copying the state (`compaction`); making several decoder steps per loop
iteration and compacting once after them copies less often, while a
sentence that ends early in an iteration is computed, and ignored, until
the iteration's end. This builds the graph from the export's own
decoder-step graph at each `--steps` count, for each of its precisions
(float32, int8), and runs the same batches of the first `--lines`
sentences (sorted by length, as `translate` batches them) through each,
repetitions interleaved, one intra-op thread, idle threads not spinning;
the best pass is kept.

Reported: sentences/s, the ratio to the first `--steps` count, and the
sentences whose tokens are the same as with it (all of them in float32; in
int8 a row's activations are quantized with its batch's rows, so carrying
an ended sentence one step longer can change another's tokens). Writes JSON
to benchmarks/results/batch_steps.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_steps")
    parser.add_argument("onnx_dir", help="a folder written by `keras-transformer export`")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--lines", type=int, default=192, help="first N sentences (default 192)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--selections",
        nargs="+",
        choices=["blocked", "topk"],
        default=["blocked"],
        help="how each step finds its best token: block by block (the export's) "
        "or one TopK over the vocabulary (default: blocked)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved passes (default 7)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "batch_steps.json"))
    return parser


def run(args):
    import numpy as np

    from benchmarks.machine import write_report
    from benchmarks.search_rows import _best, _search_feeds
    from keras_transformer.export.greedy_graph import build_greedy_batch_search

    if min(args.steps) < 1:
        raise SystemExit(f"--steps must be at least 1, not {min(args.steps)}.")
    cells = []
    for precision, translator, sources, step in cpu_precisions(args.onnx_dir, args.src, args.lines):
        batches = [
            _search_feeds(translator, sources[i : i + args.batch_size], 1)
            for i in range(0, len(sources), args.batch_size)
        ]
        sessions = graph_sessions(
            args.onnx_dir,
            translator,
            {
                (k, selection): build_greedy_batch_search(step, k, selection == "blocked")
                for k in args.steps
                for selection in args.selections
            },
        )
        outputs = {k: [s.run(None, f)[0] for f in batches] for k, s in sessions.items()}

        def runner(session, batches=batches):
            return lambda: [session.run(None, feeds) for feeds in batches]

        best = _best({k: runner(s) for k, s in sessions.items()}, args.repeats)
        base = args.steps[0], args.selections[0]
        for k, selection in sessions:
            key = k, selection
            same = sum(
                int(np.array_equal(a, b))
                for tokens, base_tokens in zip(outputs[key], outputs[base], strict=True)
                for a, b in zip(_columns(tokens), _columns(base_tokens), strict=True)
            )
            cells.append(
                {
                    "precision": precision,
                    "steps_per_iteration": k,
                    "selection": selection,
                    "batch_size": args.batch_size,
                    "sentences": len(sources),
                    "seconds": best[key],
                    "sentences_per_second": len(sources) / best[key],
                    "ratio": best[base] / best[key],
                    "identical_sentences": same,
                }
            )
            cell = cells[-1]
            print(
                f"{precision}, {k} steps per iteration, {selection} selection: "
                f"{cell['sentences_per_second']:.1f} "
                f"sentences/s ({cell['ratio']:.3f}x), {same}/{len(sources)} identical"
            )
    return write_report("batch_steps", args, cells=cells)


def cpu_precisions(onnx_dir, src, lines):
    """For each CPU precision of the export (float32, int8): `(precision, its
    translator on one intra-op thread with idle threads not spinning, the first
    `lines` sentences of `src` as token ids sorted by length, its decoder-step
    graph without its external weights)`."""
    import onnx
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer.data.pipeline import read_lines

    first = OnnxTranslator(onnx_dir, providers=["CPUExecutionProvider"], num_threads=1)
    for precision in first.manifest["precisions"]:
        if precision == "float16":  # for GPUs
            continue
        translator = OnnxTranslator(
            onnx_dir,
            providers=["CPUExecutionProvider"],
            num_threads=1,
            precision=precision,
            spinning=False,
        )
        sources = [translator.tokenizer.encode(t) for t in read_lines(src)[:lines]]
        sources.sort(key=len)
        step_file = translator._graph_files["decoder_step"]
        step = onnx.load(os.path.join(onnx_dir, step_file), load_external_data=False)
        yield precision, translator, sources, step


def graph_sessions(onnx_dir, translator, graphs):
    """One-thread, non-spinning sessions of `graphs` (key -> ModelProto built from
    `translator`'s decoder step), which read the export's weights file."""
    import onnx
    import onnxruntime as ort

    weights = translator.manifest.get("weights", {}).get(translator.precision)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {}
    with tempfile.TemporaryDirectory() as folder:
        if weights:  # the graphs read the export's weights file beside them
            shutil.copyfile(os.path.join(onnx_dir, weights), os.path.join(folder, weights))
        for i, (key, graph) in enumerate(graphs.items()):
            path = os.path.join(folder, f"graph_{i}.onnx")
            onnx.save(graph, path)
            sessions[key] = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return sessions


def _columns(tokens):
    """Each sentence's output of a `(steps, sentences)` token array: up to its first EOS or -1."""
    import numpy as np
    from keras_transformer_runtime.specials import EOS_ID

    result = []
    for column in tokens.T:
        stops = np.flatnonzero((column == EOS_ID) | (column < 0))
        result.append(column[: stops[0] + 1] if len(stops) else column)
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
