"""Training from text against `prepare` + `train --data`, as the corpus grows.

For each corpus size it generates a corpus of WMT's shape (each line joins
two random Multi30k pairs: 25-30 words a side), then runs, each in its own
process and one after the other:

- `train` from the text files (`--src-train`), until its 20th update;
- `prepare` (time, peak memory of its processes together, size on disk);
- `train --data` on the prepared directory, until its 20th update;
- the input pipeline alone: `PreparedData.batches` for `--pipeline-batches`
  batches, in target positions per second.

Memory is the proportional set size (PSS) of a process and its children
together, sampled every 0.2 s from /proc, and its anonymous part (`peak_anon`:
arrays and heap, without shared libraries and the page cache of memory-mapped
shards, whose PSS falls when other processes map the same files). Compare
sizes from one run only. "First update" is the time from the process start
to the end of its first training step. The corpora are written under `--work` and
never kept in the repository.

    python -m benchmarks.data_scale --pairs 100000 1000000 \\
        --out benchmarks/results/data_scale-tensorflow-cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import sys
import tempfile

from benchmarks import harness

UPDATES = 20

# Run in the training child: marks the first update and ends the process
# after UPDATES of them (the run's validation and final decoding are not measured).
CHILD = r"""
import os, sys, time
import keras
marks = []
def on_train_batch_end(self, batch, logs=None):
    marks.append(time.time())
    if len(marks) == 1:
        print("FIRST_UPDATE", marks[0], flush=True)
    if len(marks) == {updates}:
        print("LAST_UPDATE", marks[-1], flush=True)
        os._exit(0)
keras.callbacks.BackupAndRestore.on_train_batch_end = on_train_batch_end
from keras_transformer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def training_figures(result, tokens_per_batch) -> dict:
    marks = harness.marks(result)
    first, last = marks["FIRST_UPDATE"], marks["LAST_UPDATE"]
    samples = result["samples"]
    training = [s for s in samples if s[0] >= first] or [(0, 0, 0)]
    return {
        "first_update_seconds": round(first - result["started"], 1),
        **harness.peaks(samples),
        "peak_rss_while_training_gib": harness.gib(max(s[1] for s in training)),
        "peak_anon_while_training_gib": harness.gib(max(s[2] for s in training)),
        # Padded target positions the train step consumed per second, updates 2..UPDATES.
        "step_target_positions_per_second": round(
            tokens_per_batch * (UPDATES - 1) / (last - first)
        ),
    }


def generate_corpus(pairs: int, folder: str, multi30k: str, seed: int = 0) -> tuple[str, str]:
    """`pairs` lines, each two random Multi30k training pairs joined (de -> en)."""
    with gzip.open(os.path.join(multi30k, "train.de.gz"), "rt", encoding="utf-8") as f:
        de = f.read().splitlines()
    with gzip.open(os.path.join(multi30k, "train.en.gz"), "rt", encoding="utf-8") as f:
        en = f.read().splitlines()
    rng = random.Random(seed)
    src, tgt = os.path.join(folder, "train.de"), os.path.join(folder, "train.en")
    with open(src, "w", encoding="utf-8") as s, open(tgt, "w", encoding="utf-8") as t:
        for _ in range(pairs):
            i, j = rng.randrange(len(de)), rng.randrange(len(de))
            s.write(f"{de[i]} {de[j]}\n")
            t.write(f"{en[i]} {en[j]}\n")
    return src, tgt


def _disk_bytes(folder):
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )


def pipeline_rate(data_dir, tokens_per_batch, batches) -> dict:
    """Target positions (padded) and real target tokens per second of the stream alone."""
    code = (
        "import sys, time\n"
        "from keras_transformer.data.shards import PreparedData\n"
        f"data = PreparedData({data_dir!r})\n"
        f"stream = data.batches(0, {tokens_per_batch})\n"
        "next(stream)\n"
        "start, positions, tokens = time.perf_counter(), 0, 0\n"
        f"for _ in range({batches}):\n"
        "    s, d, lab = next(stream)\n"
        "    positions += lab.size\n"
        "    tokens += int((lab > 0).sum())\n"
        "seconds = time.perf_counter() - start\n"
        "print('RATE', positions / seconds, tokens / seconds)\n"
    )
    result = harness.run_measured([sys.executable, "-c", code])
    line = [x for x in result["output"].splitlines() if x.startswith("RATE")][0]
    _, positions, tokens = line.split()
    return {
        "target_positions_per_second": round(float(positions)),
        "target_tokens_per_second": round(float(tokens)),
        **harness.peaks(result["samples"]),
    }


def measure(pairs, args) -> dict:
    if args.work:
        os.makedirs(args.work, exist_ok=True)  # a --work folder that does not exist yet
    folder = tempfile.mkdtemp(prefix=f"data-scale-{pairs}-", dir=args.work)
    try:
        src, tgt = generate_corpus(pairs, folder, args.multi30k, args.seed)
        valid = [os.path.join(args.multi30k, f"val.{lang}.gz") for lang in ("de", "en")]
        text_bytes = os.path.getsize(src) + os.path.getsize(tgt)
        common = ["--preset", args.preset, "--max-steps", str(UPDATES + 5), "--select-by",
                  "loss", "--tokens-per-batch", str(args.tokens_per_batch)]  # fmt: skip
        row = {"pairs": pairs, "text_bytes": text_bytes}
        files = [
            "--src-train",
            src,
            "--tgt-train",
            tgt,
            "--src-valid",
            valid[0],
            "--tgt-valid",
            valid[1],
        ]
        child = [sys.executable, "-c", CHILD.replace("{updates}", str(UPDATES))]
        if args.text_up_to is None or pairs <= args.text_up_to:
            text = harness.run_measured(
                child
                + [
                    "train",
                    *files,
                    "--out",
                    os.path.join(folder, "run-text"),
                    *common,
                ]  # fmt: skip
            )
            row["train_text"] = training_figures(text, args.tokens_per_batch)
            print(pairs, "train from text:", row["train_text"], flush=True)
        if args.text_only:
            return row
        data_dir = os.path.join(folder, "prepared")
        prepared = harness.run_measured(
            [
                sys.executable,
                "-m",
                "keras_transformer.cli",
                "prepare",
                *files,
                "--out",
                data_dir,
                "--max-length",
                str(args.max_length),
            ]  # fmt: skip
        )
        with open(os.path.join(data_dir, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        row["prepare"] = {
            "seconds": round(prepared["seconds"], 1),
            **harness.peaks(prepared["samples"]),
            "disk_bytes": _disk_bytes(data_dir),
            "shards": len(manifest["shards"]),
            **manifest["stats"],
        }
        print(pairs, "prepare:", row["prepare"], flush=True)
        streamed = harness.run_measured(
            child
            + [
                "train",
                "--data",
                data_dir,
                "--out",
                os.path.join(folder, "run-data"),
                *common,
            ]  # fmt: skip
        )
        row["train_data"] = training_figures(streamed, args.tokens_per_batch)
        print(pairs, "train --data:", row["train_data"], flush=True)
        row["pipeline"] = pipeline_rate(data_dir, args.tokens_per_batch, args.pipeline_batches)
        print(pairs, "pipeline alone:", row["pipeline"], flush=True)
        return row
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--multi30k",
        default=harness.SHARED_MULTI30K,
        help="the Multi30k folder (default: ../shared)",
    )
    parser.add_argument("--max-length", type=int, default=48, help="the tiny preset's")
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--pipeline-batches", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text-up-to",
        type=int,
        help="train from text only on corpora of at most this many pairs (default: all)",
    )
    parser.add_argument("--text-only", action="store_true", help="train from text only")
    parser.add_argument("--work", default=tempfile.gettempdir(), help="where corpora are made")
    parser.add_argument("--out", default="benchmarks/results/data_scale-tensorflow-cpu.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    load, rows = [round(x, 1) for x in os.getloadavg()], []
    for pairs in args.pairs:
        rows.append(measure(pairs, args))
        # Written after each corpus: the smaller ones' figures survive a stopped run.
        load_now = [round(x, 1) for x in os.getloadavg()]
        report = harness.write_report(
            "data_scale", args, rows=rows, load_average={"start": load, "now": load_now}
        )
    print(json.dumps(report["rows"], indent=1))


if __name__ == "__main__":
    main()
