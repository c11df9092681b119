"""Training throughput of this package next to its peers, and against the matmul peak.

Every peer is built to the same shapes (`paper-base`: 6+6 layers, d_model 512,
d_ff 2048, 8 heads, a 37000-token vocabulary; `small`: the package's preset),
trained with Adam and label-smoothed cross-entropy (0.1) on the same fixed
batches, one after another in one process per configuration (shape and
token budget), with the repetitions interleaved; the median repetition is
reported, with ratios to ours. A configuration whose process runs out of
memory is reported as such and the run goes on.

Peers (`--peers`): ours, ours-bf16 (`mixed_bfloat16`), keras-hub, keras-mha
(keras.layers.MultiHeadAttention) and torch (torch.nn.Transformer); see
`benchmarks.throughput.peers`. The pieces (batches, FLOPs, matmul timers,
memory sampling, child processes) live in `benchmarks.throughput`.

The batches mimic `keras_transformer.data.make_dataset`: sentence pairs of
varied length (log-normal, median 24 tokens), grouped in the pipeline's length
buckets and padded to the bucket width, `tokens_per_batch // width` pairs per
batch. Throughput counts real (non-padding) tokens.

Model FLOPs are counted analytically (forward: every projection, the attention
scores and weighted values, the feed-forward layers and the output layer;
training = 3 x forward) on the real tokens of each batch; utilization divides
model FLOP/s by the dense float32 matmul peak measured on this machine in the
same run (the best of the backend's and torch's 4096 x 4096 matmul). On a GPU
(`KERAS_BACKEND=jax`) the peaks are ten back-to-back 8192 x 8192 products in
float32 (XLA's default precision: TF32 on recent NVIDIA GPUs) and bfloat16;
mixed-precision peers are held to the bfloat16 peak, and every row is also
given against it (`mfu_of_bfloat16_peak`); `--memory` reports the device
allocator's peak next to RSS. The peak
is measured at the start of the run and again in each configuration's process
before every round of repetitions and after the last; the highest value seen
so far is the one used, so a VM that slows down during the run does not
flatter the utilization.

    python -m benchmarks.train_throughput                      # everything
    python -m benchmarks.train_throughput --shapes small --budgets 4096
    KERAS_BACKEND=jax python -m benchmarks.train_throughput    # on a GPU machine

Prints a table and writes benchmarks/results/train_throughput-<backend>-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks import harness
from benchmarks.throughput.batches import make_batches, training_flops
from benchmarks.throughput.memory import PeakMemory, release_free_memory, rss_bytes
from benchmarks.throughput.peers import EXTRA_PEERS, PEERS, make_peer
from benchmarks.throughput.processes import run_in_fresh_process
from benchmarks.throughput.timing import best_peaks, library_peaks

SHAPES = ("small", "paper-base")  # the default run
ALL_SHAPES = SHAPES + ("paper-big",)  # Transformer-big, for GPU runs
BUDGETS = (4096, 25000)


def _precision(name, args):
    """The matmul peak a peer is held to: on a GPU the mixed-precision peers are
    held to the peak of their 16-bit type (`--mixed-precision`), else float32."""
    mixed = name.endswith("-bf16") or "-bf16-" in name or (name == "torch" and args.device != "cpu")
    if mixed and args.device != "cpu":
        return args.mixed_precision
    return "float32"


def setup_model(config_name, budget, args):
    from keras_transformer import TransformerConfig

    overrides = {"vocabulary_size": 37000} if config_name.startswith("paper") else {}
    config = TransformerConfig.from_preset(config_name, **overrides)
    return config, make_batches(config.max_length, budget, args.batches, config.vocabulary_size)


def memory_probe(config_name, budget, name, args):
    """In a fresh process: RSS with the frameworks loaded, then the peak over training steps.

    Returns one row. Peers that share a process also share freed memory, so
    their peaks can only be told apart one process each.
    """
    import resource

    import keras

    args.device = _device()
    config, batches = setup_model(config_name, budget, args)
    keras.ops.convert_to_numpy(keras.ops.ones((2, 2)) @ keras.ops.ones((2, 2)))
    if name == "torch":
        import torch

        (torch.ones(2, 2) @ torch.ones(2, 2)).sum().item()
    baseline = rss_bytes()
    peer = make_peer(name, config, args)
    prepared = [peer.prepare(b) for b in batches]
    for _ in range(2):
        for item in prepared:
            peer.step(item)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {
        "shape": config_name,
        "tokens_per_batch": budget,
        "peer": name,
        "peak_rss_gib": peak / 2**30,
        "framework_rss_gib": baseline / 2**30,
        "peak_above_framework_gib": (peak - baseline) / 2**30,
    }
    if args.device != "cpu":  # the allocators' peak bytes in use on the GPU
        if name == "torch":
            import torch

            device_peak = torch.cuda.max_memory_allocated()
        else:
            import jax

            device_peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
        row["device_peak_gib"] = device_peak / 2**30
    return row


def measure_memory(args, save):
    """Runs `memory_probe` in a fresh process for every configuration and peer.

    `save(rows)` is called after every probe, so a long run keeps what it measured.
    """
    rows = []
    for shape in args.shapes:
        for budget in args.budgets:
            for name in args.peers:
                row, reason = run_in_fresh_process(memory_probe, shape, budget, name, args)
                if reason:
                    rows.append(
                        {"shape": shape, "tokens_per_batch": budget, "peer": name, "error": reason}
                    )
                    print(f"  {shape:<11}{budget:>6} {name:<10} failed: {reason}", flush=True)
                    save(rows)
                    continue
                rows.append(row)
                device = (
                    f", device peak {row['device_peak_gib']:.2f} GiB"
                    if "device_peak_gib" in row
                    else ""
                )
                print(
                    f"  {shape:<11}{budget:>6} {name:<10} peak RSS {row['peak_rss_gib']:.2f} GiB "
                    f"({row['peak_above_framework_gib']:.2f} GiB above the loaded framework)"
                    f"{device}",
                    flush=True,
                )
                save(rows)
    return rows


def benchmark(config_name, budget, peers, args, peak_gflops):
    """Runs `peers` on one configuration; `peak_gflops` maps precision -> matmul peak."""
    config, batches = setup_model(config_name, budget, args)
    real_target = int(sum(b["target_lengths"].sum() for b in batches))
    real_source = int(sum(b["source_lengths"].sum() for b in batches))
    padded = int(sum(b["source"].size for b in batches))
    flops = sum(training_flops(config, b["source_lengths"], b["target_lengths"]) for b in batches)
    print(
        f"\n{config_name}, ~{budget} tokens per batch: {len(batches)} batches "
        f"{[b['source'].shape for b in batches]}, {real_source} source + {real_target} "
        f"target real tokens ({1 - real_target / padded:.0%} of the target positions "
        f"are padding), {flops / 1e12:.2f} TFLOP per pass",
        flush=True,
    )
    built = {}
    for name in list(peers):
        with PeakMemory() as memory:
            start = time.perf_counter()
            try:
                peer = make_peer(name, config, args)
            except ImportError as error:  # e.g. no torch or keras-hub on this machine
                print(f"  {name}: skipped ({error}); pip install '.[bench]' installs the peers")
                peers = [p for p in peers if p != name]
                continue
            prepared = [peer.prepare(b) for b in batches]
            for item in prepared:  # warm-up: traces and compiles every shape
                peer.step(item)
            warm = time.perf_counter() - start
        release_free_memory()
        built[name] = {
            "peer": peer,
            "prepared": prepared,
            "warmup_seconds": warm,
            # What the peer keeps (weights, optimizer state, compiled steps).
            "resident": rss_bytes() - memory.start_rss,
            "step_memory": [],
            "times": [],
            "cpu": [],
            "losses": [],
        }
        print(f"  {name}: built and warmed up in {warm:.1f} s", flush=True)
    # The matmul peak again, in this process, before every round of repetitions:
    # a VM's speed drifts, and utilization is taken against the highest peak
    # seen in the run (the parent's measurement included), never a lower one.
    peaks_seen = {precision: [value] for precision, value in peak_gflops.items()}

    def measure_peak_here():
        for precision, value in best_peaks(
            library_peaks(peers, args.device, 3, args.mixed_precision)
        ).items():
            peaks_seen.setdefault(precision, []).append(value)
        print(
            "  matmul peak now: "
            + ", ".join(f"{k} {v[-1]:.0f} GFLOP/s" for k, v in peaks_seen.items()),
            flush=True,
        )

    for repeat in range(args.repeats):
        measure_peak_here()
        for name in peers:  # interleaved
            entry = built[name]
            with PeakMemory() as memory:
                cpu = time.process_time()
                start = time.perf_counter()
                losses = [entry["peer"].step(item) for item in entry["prepared"]]
                elapsed = time.perf_counter() - start
                cpu = time.process_time() - cpu
            entry["step_memory"].append(memory.increase)
            entry["times"].append(elapsed)
            entry["cpu"].append(cpu)
            entry["losses"].append(losses)
            print(f"  repeat {repeat + 1} {name}: {elapsed:.2f} s ({cpu:.1f} s CPU)", flush=True)
    measure_peak_here()
    peak_used = {precision: max(values) for precision, values in peaks_seen.items()}
    rows = []
    for name in peers:
        entry = built[name]
        median = statistics.median(entry["times"])
        precision = _precision(name, args)
        rows.append(
            {
                "shape": config_name,
                "tokens_per_batch": budget,
                "peer": name,
                "parameters": int(entry["peer"].parameters),
                "median_seconds": median,
                "seconds": entry["times"],
                "cpu_seconds": entry["cpu"],
                "target_tokens_per_second": real_target / median,
                "tokens_per_second": (real_source + real_target) / median,
                "model_tflops_per_second": flops / median / 1e12,
                "mfu": flops / median / 1e9 / peak_used[precision],
                # On a GPU every peer is also held to the dense bfloat16 peak.
                "mfu_of_bfloat16_peak": (
                    flops / median / 1e9 / peak_used["bfloat16"]
                    if "bfloat16" in peak_used
                    else None
                ),
                "peak_precision": precision,
                "peak_gflops": peak_used[precision],
                "peaks_measured_gflops": peaks_seen[precision],
                # In-process RSS figures, for the record: peers in one process
                # reuse each other's freed memory, so `--memory` (one process
                # per peer) is what tells their needs apart.
                "resident_gib": entry["resident"] / 2**30,
                "step_rss_increase_gib": [m / 2**30 for m in entry["step_memory"]],
                "warmup_seconds": entry["warmup_seconds"],
                "first_loss": entry["losses"][0][0],
                "batches": [list(b["source"].shape) for b in batches],
                "real_source_tokens": real_source,
                "real_target_tokens": real_target,
                "padded_tokens_per_side": padded,
                "model_tflop_per_pass": flops / 1e12,
            }
        )
    built.clear()
    import keras

    keras.backend.clear_session()
    release_free_memory()
    for key, ours in (("ours_speedup", "ours"), ("ours_bf16_speedup", "ours-bf16")):
        base = next((r for r in rows if r["peer"] == ours), None)
        for row in rows:  # > 1: ours is faster than this peer
            row[key] = (
                base["target_tokens_per_second"] / row["target_tokens_per_second"] if base else None
            )
    return rows


def _configuration_child(shape, budget, args, peak):
    args.device = _device()
    return benchmark(shape, budget, args.peers, args, peak)


def run_configuration(shape, budget, args, peak):
    """`benchmark` for one configuration, in a fresh process; returns its rows.

    All peers of a configuration still share that one process (built one
    after another, repetitions interleaved). A configuration that needs more
    memory than the machine has is then killed alone: its row says so and the
    run goes on with the next configuration.
    """
    rows, reason = run_in_fresh_process(_configuration_child, shape, budget, args, peak)
    if reason is None:
        return rows
    if "SIGKILL" in reason:
        reason += (
            ": the peers of a configuration share one process; `--memory` measures each peer alone"
        )
    print(f"\n{shape}, ~{budget} tokens per batch: {reason}", flush=True)
    return [
        {"shape": shape, "tokens_per_batch": budget, "peers": list(args.peers), "error": reason}
    ]


def print_table(rows):
    print(
        "\nMFU: model FLOP/s over the highest dense matmul rate of its precision "
        "measured in the run up to the end of that configuration ('peak', GFLOP/s)"
    )
    bf16 = any(r.get("mfu_of_bfloat16_peak") for r in rows)
    header = (
        f"{'shape':<11}{'tok/batch':>10} {'peer':<10}{'tgt tok/s':>11}{'all tok/s':>11}"
        f"{'TFLOP/s':>9}{'peak':>7}{'MFU':>7}"
        + (f"{'MFU/bf16':>9}" if bf16 else "")
        + f"{'ours/peer':>11}{'bf16/peer':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<11}{r['tokens_per_batch']:>10} (all)      {r['error']}")
            continue
        ratios = [
            f"{r[key]:.2f}x" if r.get(key) else "-" for key in ("ours_speedup", "ours_bf16_speedup")
        ]
        print(
            f"{r['shape']:<11}{r['tokens_per_batch']:>10} {r['peer']:<10}"
            f"{r['target_tokens_per_second']:>11.0f}{r['tokens_per_second']:>11.0f}"
            f"{r['model_tflops_per_second']:>9.3f}{r['peak_gflops']:>7.0f}{r['mfu']:>7.1%}"
            + (f"{r.get('mfu_of_bfloat16_peak') or 0:>9.1%}" if bf16 else "")
            + f"{ratios[0]:>11}{ratios[1]:>11}"
        )


def _device():
    """ "cpu", or the platform of the JAX backend's first device ("gpu")."""
    import keras

    if keras.backend.backend() != "jax":
        return "cpu"
    import jax

    return jax.devices()[0].platform


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=ALL_SHAPES)
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS + EXTRA_PEERS)
    parser.add_argument("--batches", type=int, default=2, help="distinct batches per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mixed-precision", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile Keras peers with XLA under TensorFlow too (JAX always compiles)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="measure peak RSS instead, each peer in a process of its own",
    )
    args = parser.parse_args(argv)
    # On a GPU, JAX would otherwise take 75% of the device memory at start-up,
    # leaving torch (a peer in the same process) the rest, and hiding each
    # peer's real need. Set before any child imports JAX.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    command = "python -m benchmarks.train_throughput " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.memory:  # no matmul peak needed: each probe is a process of its own
        import keras

        out = args.out or os.path.join(
            harness.RESULTS, f"train_memory-{keras.backend.backend()}-{_device()}.json"
        )
        machine = harness.describe_machine()
        measure_memory(
            args,
            lambda rows: harness.write_json(
                out, {"command": command, "machine": machine, "rows": rows}
            ),
        )
        print(f"wrote {out}")
        return

    # This process imports no framework: the children get the whole machine
    # (and, on a GPU, the whole device memory).
    measured, reason = run_in_fresh_process(measure_peaks, args)
    if reason:
        sys.exit(f"error: measuring the matmul peak failed ({reason})")
    peaks, peak = measured["peaks"], measured["peak"]
    args.device = measured["device"]
    out = args.out or os.path.join(
        harness.RESULTS, f"train_throughput-{measured['backend']}-{measured['device']}.json"
    )
    print("matmul GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), flush=True)
    rows = []
    for shape in args.shapes:
        for budget in args.budgets:
            new_rows = run_configuration(shape, budget, args, peak)
            rows.extend(new_rows)
            for row in new_rows:  # the next configuration starts from the highest peak
                if "peak_gflops" in row:
                    precision = row["peak_precision"]
                    peak[precision] = max(peak[precision], row["peak_gflops"])
            print_table(rows)
            harness.write_json(  # after every configuration, so a long run keeps what it measured
                out,
                {
                    "command": command,
                    "machine": measured["machine"],
                    "matmul_peak_gflops": peaks,
                    "highest_peak_gflops": peak,  # the highest seen so far in the run
                    "settings": vars(args),
                    "rows": rows,
                },
            )
            print(f"wrote {out}", flush=True)


def measure_peaks(args):
    """The dense matmul peaks of the backend (and torch), measured in this process."""
    import keras

    backend = keras.backend.backend()
    device = _device()
    machine = harness.describe_machine()
    if device != "cpu":
        import jax

        gpu = jax.devices()[0]
        machine["device"] = gpu.device_kind
        machine["jax"] = jax.__version__
        # What JAX may allocate (75% of the device memory by default).
        machine["jax_memory_limit_gib"] = round(
            (gpu.memory_stats() or {}).get("bytes_limit", 0) / 2**30, 1
        )
        # None means XLA's default, which on NVIDIA GPUs since Ampere runs
        # float32 matmuls on the tensor cores in TF32: the float32 peak
        # and the float32 peers alike.
        machine["jax_default_matmul_precision"] = jax.config.jax_default_matmul_precision
        if "torch" in args.peers:
            try:
                import torch

                machine["torch"] = torch.__version__
            except ImportError:
                pass
    else:
        machine["device"] = device
    peaks = library_peaks(args.peers, device, mixed=args.mixed_precision)
    return {
        "backend": backend,
        "device": device,
        "machine": machine,
        "peaks": peaks,
        "peak": best_peaks(peaks),
    }


if __name__ == "__main__":
    main()
