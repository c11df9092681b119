"""How a batch is cut into one part per thread: `python -m benchmarks.split_runs`.

`OnnxTranslator` searches a batch on N CPU threads as N parts at once
(`split_batches`). This compares, interleaved in one process, the parts
dealt out in turn in order of length ("dealt": every part as long as the
batch's longest sentence) against runs in order of length sized to end
together (`length_runs`) for several `step_rows`, on batches of 32 sorted by
length (the offline translator) and in arrival order (a server's batches).
The translations must be identical in every variant; the script fails
otherwise.

    python -m benchmarks.split_runs --onnx EXPORT --source test.de.gz --limit 1000 \\
        --out benchmarks/results/split_runs.json
"""

from __future__ import annotations

import argparse
import sys
import time

import keras_transformer_runtime.runtime as runtime
import numpy as np
from keras_transformer_runtime import OnnxTranslator

from benchmarks.serve_load import DEFAULT_SOURCE, read_sentences


def dealt(lengths, parts):
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[j::parts] for j in range(parts)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--source", default=DEFAULT_SOURCE)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--step-rows", default="0,8,16", help="values of length_runs' step_rows")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    sentences = read_sentences(args.source, args.limit)
    translator = OnnxTranslator(args.onnx)
    runs = runtime.length_runs
    variants = {"dealt": dealt}
    for value in (int(v) for v in args.step_rows.split(",")):
        variants[f"runs, step_rows {value}"] = lambda lengths, parts, v=value: runs(
            lengths, parts, v
        )
    for beam_size in (1, 4):
        translator.translate(sentences[:64], beam_size=beam_size)  # warm-up
    rates, outputs = {}, {}
    try:
        for _ in range(args.rounds):
            for name, cut in variants.items():
                runtime.length_runs = cut
                for beam_size in (1, 4):
                    for batches in ("sorted", "in order"):
                        started = time.perf_counter()
                        if batches == "sorted":
                            out = translator.translate(sentences, beam_size=beam_size)
                        else:
                            out = []
                            for i in range(0, len(sentences), 32):
                                out += translator.translate(
                                    sentences[i : i + 32], beam_size=beam_size
                                )
                        rate = len(sentences) / (time.perf_counter() - started)
                        key = f"{name} | beam {beam_size} | {batches}"
                        rates.setdefault(key, []).append(round(rate, 1))
                        if outputs.setdefault((beam_size, batches), out) != out:
                            raise SystemExit(f"{key}: other translations than the first variant")
    finally:
        runtime.length_runs = runs
    rows = [
        {"cell": key, "sentences_per_s": values, "median": float(np.median(values))}
        for key, values in rates.items()
    ]
    for row in rows:
        print(f"{row['cell']:40s} {row['median']:8.1f}  {row['sentences_per_s']}")
    from benchmarks.machine import write_report

    return write_report("split_runs", args, threads=translator.threads(), rows=rows)


if __name__ == "__main__":
    main()
