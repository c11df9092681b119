"""How fast could one training step be if it were only its matrix products?

Lists every matrix product of one training step of this package's model
(forward, and the two products of each backward: the input gradient and the
weight gradient, with the operand orientations TensorFlow's gradients use),
times each distinct product alone on the padded batch of
`benchmarks.train_throughput` (the best of `--repeats` timings in each of
`--rounds` passes over the list, as the peak is a best time), and adds them
up. That sum bounds the step from below on this machine and library;
divided into the step's model FLOPs (real tokens, the count of
`train_throughput`) and the dense matmul peak measured in the same process,
it bounds the model FLOPs utilization that any implementation calling these
products could reach. With `--step N` the real training step (ours, float32)
is timed too, after the products, in the same process: median of N after
two warm-up steps.

    python -m benchmarks.matmul_ceiling --shape paper-base --budget 25000 --step 3

Prints one line per product and a summary; writes JSON
(`benchmarks/results/matmul_ceiling-<backend>-<shape>-<budget>.json` by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.machine import describe_machine
from benchmarks.throughput.batches import training_flops
from benchmarks.throughput.timing import matmul_peak, time_product
from benchmarks.train_throughput import setup_model, write_json


def step_products(config, batch_size, source_len, target_len):
    """The step's matrix products as dicts: name, count, batch, m, k, n,
    transpose_a, transpose_b (C[batch] = op(A) @ op(B), op(A) m x k)."""
    d, ff, heads, vocab = (
        config.hidden_dim,
        config.intermediate_dim,
        config.num_heads,
        config.vocabulary_size,
    )
    head = d // heads
    layers = config.num_layers
    rs, rt = batch_size * source_len, batch_size * target_len
    bh = batch_size * heads
    products = []

    def add(name, count, m, k, n, ta=False, tb=False, batch=1):
        products.append(
            dict(name=name, count=count, batch=batch, m=m, k=k, n=n, transpose_a=ta, transpose_b=tb)
        )

    def dense(name, count, rows, k, n):
        # y = x @ W; dx = g @ W^T; dW = x^T @ g
        add(f"{name} forward", count, rows, k, n)
        add(f"{name} dx", count, rows, n, k, tb=True)
        add(f"{name} dW", count, k, rows, n, ta=True)

    def attention(name, count, t, s):
        # scores = q @ k^T; dq = g @ k; dk = g^T @ q
        add(f"{name} scores forward", count, t, head, s, tb=True, batch=bh)
        add(f"{name} scores dq", count, t, s, head, batch=bh)
        add(f"{name} scores dk", count, s, t, head, ta=True, batch=bh)
        # out = w @ v; dw = g @ v^T; dv = w^T @ g
        add(f"{name} values forward", count, t, s, head, batch=bh)
        add(f"{name} values dw", count, t, head, s, tb=True, batch=bh)
        add(f"{name} values dv", count, s, t, head, ta=True, batch=bh)

    dense("encoder projection", 4 * layers, rs, d, d)
    dense("encoder ffn in", layers, rs, d, ff)
    dense("encoder ffn out", layers, rs, ff, d)
    attention("encoder self-attention", layers, source_len, source_len)
    dense("decoder projection", 6 * layers, rt, d, d)  # self Q K V O, cross Q O
    dense("cross-attention key/value", 2 * layers, rs, d, d)
    dense("decoder ffn in", layers, rt, d, ff)
    dense("decoder ffn out", layers, rt, ff, d)
    attention("decoder self-attention", layers, target_len, target_len)
    attention("cross-attention", layers, target_len, source_len)
    # Tied output layer: logits = y @ E^T; dy = g @ E; dE = g^T @ y.
    add("output forward", 1, rt, d, vocab, tb=True)
    add("output dy", 1, rt, vocab, d)
    add("output dE", 1, vocab, rt, d, ta=True)
    return products


def _shape_key(product):
    return tuple(product[k] for k in ("batch", "m", "k", "n", "transpose_a", "transpose_b"))


def _timer(product, repeats):
    """Best seconds of one product alone, on the current backend."""
    import keras

    lead = (product["batch"],) if product["batch"] > 1 else ()
    m, k, n = product["m"], product["k"], product["n"]
    ta, tb = product["transpose_a"], product["transpose_b"]
    return time_product(
        keras.backend.backend(),
        lead + ((k, m) if ta else (m, k)),
        lead + ((n, k) if tb else (k, n)),
        transpose_a=ta,
        transpose_b=tb,
        repeats=repeats,
    )


def time_training_step(config, batch, steps):
    """Median seconds of `steps` training steps of ours (float32), after two warm-up steps."""
    from benchmarks.throughput.peers.keras_peers import KerasPeer, build_ours

    peer = KerasPeer("ours", build_ours, config)
    prepared = peer.prepare(batch)
    for _ in range(2):
        peer.step(prepared)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        peer.step(prepared)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="paper-base", choices=["small", "paper-base"])
    parser.add_argument("--budget", type=int, default=25000, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=2, help="timings per product and round")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the products")
    parser.add_argument("--step", type=int, default=0, help="also time N training steps")
    parser.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="side of the square product that measures the peak (default 4096 on a CPU, "
        "8192 on a GPU)",
    )
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.budget < 1 or args.repeats < 1 or args.rounds < 1 or args.step < 0:
        parser.error("--budget, --repeats and --rounds must be positive, --step not negative")
    if args.peak_size is not None and args.peak_size < 1:
        parser.error(f"--peak-size must be positive; got {args.peak_size}")

    import keras

    backend = keras.backend.backend()
    config, batches = setup_model(args.shape, args.budget, argparse.Namespace(batches=1))
    batch = batches[0]
    batch_size, width = batch["source"].shape
    target_width = batch["target_in"].shape[1]
    model_flops = training_flops(config, batch["source_lengths"], batch["target_lengths"])
    peaks = [matmul_peak(backend, args.peak_size)]
    print(
        f"{args.shape}, ~{args.budget} tokens: batch {batch_size} x {width} (source), "
        f"x {target_width} (target), "
        f"model {model_flops / 1e12:.2f} TFLOP per step (real tokens); "
        f"matmul peak {peaks[0]:.0f} GFLOP/s",
        flush=True,
    )
    products = step_products(config, batch_size, width, target_width)
    # Products of the same shape and orientation (e.g. the encoder's and the
    # decoder's projections when both sides have the same width) are timed
    # once. The list is gone through `--rounds` times, the peak re-measured
    # after each round, and each product keeps its best time: on a VM whose
    # speed drifts, a slow spell then does not land on a few products only.
    best = {}
    for round_index in range(args.rounds):
        for product in products:
            key = _shape_key(product)
            if key in best and len(best[key]) > round_index:
                continue
            best.setdefault(key, []).append(_timer(product, args.repeats))
        peaks.append(matmul_peak(backend, args.peak_size))
        print(f"  round {round_index + 1}: peak {peaks[-1]:.0f} GFLOP/s", flush=True)
    rows, total_seconds, padded_flops = [], 0.0, 0.0
    for product in products:
        rounds = best[_shape_key(product)]
        seconds = min(rounds)
        flops = 2.0 * product["batch"] * product["m"] * product["k"] * product["n"]
        total_seconds += product["count"] * seconds
        padded_flops += product["count"] * flops
        rows.append(
            dict(
                product,
                seconds=seconds,
                seconds_by_round=rounds,
                gflops_per_second=flops / seconds / 1e9,
            )
        )
        print(
            f"  {product['name']:38s} x{product['count']:<3d} "
            f"{flops / seconds / 1e9:6.1f} GFLOP/s  {product['count'] * seconds:7.2f} s",
            flush=True,
        )
    peak = max(peaks)
    summary = {
        "model_tflop": model_flops / 1e12,
        "padded_matmul_tflop": padded_flops / 1e12,
        "matmul_seconds": total_seconds,
        "matmul_gflops_per_second": padded_flops / total_seconds / 1e9,
        "peaks_measured_gflops": peaks,
        "peak_gflops": peak,
        "mfu_ceiling": model_flops / total_seconds / 1e9 / peak,
    }
    print(
        f"products alone: {total_seconds:.2f} s for {padded_flops / 1e12:.2f} TFLOP "
        f"({summary['matmul_gflops_per_second']:.0f} GFLOP/s); peaks {[round(p) for p in peaks]}; "
        f"MFU ceiling {summary['mfu_ceiling']:.1%} of {peak:.0f} GFLOP/s",
        flush=True,
    )
    if args.step:
        median, times = time_training_step(config, batch, args.step)
        summary.update(
            step_seconds=median,
            step_times=times,
            step_mfu=model_flops / median / 1e9 / peak,
            products_share_of_step=total_seconds / median,
        )
        print(
            f"training step (ours, float32): median {median:.2f} s of {[round(t, 2) for t in times]}"
            f"; MFU {summary['step_mfu']:.1%}; the products alone are "
            f"{summary['products_share_of_step']:.0%} of it",
            flush=True,
        )
    out = args.out or (
        f"benchmarks/results/matmul_ceiling-{backend}-{args.shape}-{args.budget}.json"
    )
    write_json(
        out,
        {
            "command": "python -m benchmarks.matmul_ceiling " + " ".join(sys.argv[1:]),
            "machine": describe_machine(),
            "shape": args.shape,
            "tokens_per_batch": args.budget,
            "batch": [int(batch_size), int(width), int(target_width)],
            "summary": summary,
            "products": rows,
        },
    )
    print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
