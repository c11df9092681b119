"""The same `train` command under TensorFlow and under JAX (`--strategy data-parallel`, one
process): wall time, time to the first update, training seconds and peak memory, for a
new run and for a restart of the JAX run (which finds its compiled programs in the run's
compile cache), one process at a time.

    python -m benchmarks.train_backends --preset tiny --max-steps 500 \\
        --out benchmarks/results/train-backends-tiny-zen4.json

Also reports the share of real tokens in the padded batches of both batch shapes
(`--batch-shapes fine` and `few`) on the training pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

from benchmarks import harness

# Run in the child: prints when the first update of this start ends.
CHILD = r"""
import sys, time
sys.argv[0] = "keras-transformer"  # the command's start-up (keras_transformer.startup)
from keras_transformer.cli import main
import keras
seen = []
def on_train_batch_end(self, batch, logs=None):
    if not seen:
        seen.append(1)
        print("FIRST_UPDATE", time.time(), flush=True)
keras.callbacks.BackupAndRestore.on_train_batch_end = on_train_batch_end
sys.exit(main(sys.argv[1:]))
"""


def _command(args, out, max_steps, *extra):
    files = []
    for flag, name in (("--src-train", "train.de.gz"), ("--tgt-train", "train.en.gz"),
                       ("--src-valid", "val.de.gz"), ("--tgt-valid", "val.en.gz")):  # fmt: skip
        files += [flag, os.path.join(args.data, name)]
    return [sys.executable, "-c", CHILD, "train", *files, "--out", out, "--preset", args.preset,
            "--max-steps", str(max_steps), "--select-by", "loss", *extra]  # fmt: skip


def _measure(name, command, backend, out) -> dict:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = harness.run_measured(command, env=env)
    with open(os.path.join(out, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    figures = {
        "run": name,
        "seconds": round(result["seconds"], 1),
        "first_update_seconds": round(harness.marks(result)["FIRST_UPDATE"] - result["started"], 1),
        "train_seconds": metrics["train_seconds"],
        "steps": metrics["steps"],
        **harness.peaks(result["samples"]),
    }
    print(json.dumps(figures), flush=True)
    return figures


def real_token_shares(run_dir, data, tokens_per_batch, max_length) -> dict:
    """Real tokens over padded positions of one epoch, per batch shape."""
    from keras_transformer.data.pipeline import BATCH_SHAPES, bucket_rows, read_parallel
    from keras_transformer.data.tokenizer import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer.load(os.path.join(run_dir, "spm.model"))
    sources, targets = read_parallel(*(os.path.join(data, f"train.{s}.gz") for s in ("de", "en")))
    lengths = [
        (len(tokenizer.encode(s)) + 1, len(tokenizer.encode_target(t)) + 1)
        for s, t in zip(sources, targets, strict=True)
    ]
    lengths = np.asarray([(s, t) for s, t in lengths if max(s, t) <= max_length])
    real = int(lengths.sum())
    shares = {}
    for name, shapes in BATCH_SHAPES.items():
        boundaries = shapes.boundaries(max_length)
        rows = bucket_rows(boundaries, tokens_per_batch)
        # The pipeline's bucket of a pair: the first boundary at or above its longer side.
        counts = np.bincount(
            np.searchsorted(boundaries, lengths.max(axis=1)), minlength=len(boundaries)
        )
        padded = 0
        for width, n, full in zip(boundaries, counts.tolist(), rows, strict=True):
            batches, rest = divmod(n, full)
            last = (full if shapes.fixed_rows else rest) if rest else 0
            padded += 2 * width * (batches * full + last)
        distinct = sum(1 for n in counts if n) * (1 if shapes.fixed_rows else 2)
        shares[name] = {"real_share": round(real / padded, 4), "shapes_at_most": distinct}
    return shares


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=harness.SHARED_MULTI30K, help="a Multi30k folder (de, en)"
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--folder", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--out", required=True, help="the JSON report")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    folder = args.folder or tempfile.mkdtemp(prefix="train-backends-")
    tf_out, jax_out = os.path.join(folder, "tensorflow"), os.path.join(folder, "jax")
    jax = ("--strategy", "data-parallel")
    rows = [
        _measure("tensorflow", _command(args, tf_out, args.max_steps), "tensorflow", tf_out),
        _measure("jax", _command(args, jax_out, args.max_steps, *jax), "jax", jax_out),
        # The same command with a larger budget resumes the JAX run (its backup, its cache).
        _measure("jax resumed, +10 updates",
                 _command(args, jax_out, args.max_steps + 10, *jax), "jax", jax_out),
    ]  # fmt: skip
    with open(os.path.join(tf_out, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    shares = real_token_shares(
        tf_out, args.data, metrics["tokens_per_batch"], metrics["config"]["max_length"]
    )
    base = rows[0]
    print(f"| run | wall s | first update s | training s | peak PSS GiB | wall / {base['run']} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['run']} | {row['seconds']} | {row['first_update_seconds']} | "
              f"{row['train_seconds']} | {row['peak_rss_gib']} | "
              f"{row['seconds'] / base['seconds']:.2f}x |")  # fmt: skip
    for name, share in shares.items():
        print(f"batch shapes {name}: {share['real_share']:.1%} real tokens, "
              f"at most {share['shapes_at_most']} shapes")  # fmt: skip
    harness.write_report("train_backends", args, rows=rows, batch_shapes=shares)


if __name__ == "__main__":
    main()
