"""Decoding speed: uncached greedy vs KV-cached greedy vs cached beam 4.

Random weights, every output forced to `--tokens` tokens (EOS ignored), batch
sizes 1 and 32, on the `small` and `paper-base` shapes. Repetitions are
interleaved across the methods; medians are reported.

    python -m benchmarks.decode                       # both shapes
    python -m benchmarks.decode --shapes small --repeats 5

Prints a table and writes benchmarks/results/decode-<backend>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import keras
import numpy as np

from benchmarks.machine import describe_machine
from keras_transformer import TransformerConfig, build_transformer
from keras_transformer.decoding import beam_search, greedy_search
from keras_transformer.io_utils import atomic_write_json

METHODS = {
    "greedy_uncached": lambda m, s, n: greedy_search(
        m, s, max_length=n, use_cache=False, ignore_eos=True
    ),
    "greedy_cached": lambda m, s, n: greedy_search(m, s, max_length=n, ignore_eos=True),
    "beam4_cached": lambda m, s, n: beam_search(m, s, beam_size=4, max_length=n, ignore_eos=True),
}


def sources(batch_size, length, vocabulary_size, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocabulary_size, size=(batch_size, length)).astype(np.int32)


def run(shapes, batch_sizes, tokens, repeats, source_length, vocabulary_size):
    rows = []
    for shape in shapes:
        config = TransformerConfig.from_preset(
            shape, vocabulary_size=vocabulary_size, max_length=max(256, tokens + 8)
        )
        keras.utils.set_random_seed(0)
        model = build_transformer(config)
        for batch_size in batch_sizes:
            src = sources(batch_size, source_length, vocabulary_size)
            for fn in METHODS.values():  # warm-up: traces and compiles
                fn(model, src, tokens)
            times = {name: [] for name in METHODS}
            for _ in range(repeats):
                for name, fn in METHODS.items():  # interleaved
                    start = time.perf_counter()
                    out, _ = fn(model, src, tokens)
                    times[name].append(time.perf_counter() - start)
                    assert all(len(o) == tokens for o in out)
            for name, values in times.items():
                median = statistics.median(values)
                rows.append(
                    {
                        "shape": shape,
                        "batch_size": batch_size,
                        "method": name,
                        "median_seconds": median,
                        "sentences_per_second": batch_size / median,
                        "ms_per_token": 1000 * median / tokens,
                        "repeats": values,
                    }
                )
            base = next(
                r["median_seconds"]
                for r in rows
                if r["shape"] == shape
                and r["batch_size"] == batch_size
                and r["method"] == "greedy_uncached"
            )
            for r in rows[-len(METHODS) :]:
                r["speedup_vs_uncached"] = base / r["median_seconds"]
            print_rows(rows[-len(METHODS) :])
    return rows


def print_rows(rows):
    for r in rows:
        print(
            f"{r['shape']:>10} | batch {r['batch_size']:>3} | {r['method']:<16} | "
            f"{r['sentences_per_second']:>9.2f} sent/s | {r['ms_per_token']:>8.2f} ms/token | "
            f"x{r['speedup_vs_uncached']:.2f} vs uncached",
            flush=True,
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["small", "paper-base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--tokens", type=int, default=50, help="output tokens per sentence")
    parser.add_argument("--source-length", type=int, default=30)
    parser.add_argument("--vocabulary-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    print(
        f"{'shape':>10} | {'batch':>9} | {'method':<16} | {'throughput':>16} | "
        f"{'latency':>17} | speed-up"
    )
    rows = run(
        args.shapes,
        args.batch_sizes,
        args.tokens,
        args.repeats,
        args.source_length,
        args.vocabulary_size,
    )
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"decode-{keras.backend.backend()}.json"
    )
    atomic_write_json(out, {"machine": describe_machine(), "settings": vars(args), "rows": rows})
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
