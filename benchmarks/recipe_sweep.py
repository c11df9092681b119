"""Multi30k recipe proxies on an accelerator: many settings at the full epoch budget, side by side.

    python -m benchmarks.recipe_sweep prepare --pair en de --out .sweep
    KERAS_BACKEND=jax python -m benchmarks.recipe_sweep run --data .sweep --out DIR \\
        --configs small small-seed1 deep6 ...

The CPU runs of `keras-transformer train` take one to two hours each here, so
a recipe search of a dozen settings does not fit a session. This runs the
same model code (`build_transformer`, `transformer_optimizer`,
`LabelSmoothedCrossEntropy`, the Keras searches) under JAX on a GPU, one
process per setting, all at once, and scores every epoch on val.

What it keeps from `keras-transformer train`, so that a proxy predicts the
CPU run: the SentencePiece model of the CPU recipe (`prepare` copies it, or
trains one the same way), the pairs kept (`max_length`), the length buckets
and the sentences per batch (`bucket_boundaries`, `tokens_per_batch //
bucket`), the automatic warm-up (three epochs of updates) and peak learning
rate, label smoothing, and the final weights chosen on val among the means
of the last and the best k epochs. What differs: batches are padded to a few
shapes (all-padding rows and columns, which the loss and the attention masks
ignore) so that XLA compiles a handful of programs; float32 runs as TF32 on
the tensor cores; the batch order and the dropout masks come from other
random streams. So only differences well above the seed-to-seed spread (run
two seeds of the baseline) are worth confirming with a CPU run.

`run` writes `DIR/sweep.json` (every setting's curve and scores, rewritten
as the processes report) and `DIR/sweep.log`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

DEFAULT_DATA = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "multi30k"
    )
)
TEST = "test_2016_flickr"
TOKENS_PER_BATCH = 1024
# Batch widths the padded batches are rounded up to: one compiled program each
# (every Multi30k pair fits 56 positions; compiling dominates a proxy's time).
WIDTHS = (56, 128)

# Each setting: TransformerConfig overrides ("model") and training settings.
BASE = dict(preset="small", epochs=20, dropout=0.1, attention_dropout=None, label_smoothing=0.1,
            lr_mult=1.0, seed=0, tokens=TOKENS_PER_BATCH, rdrop=0.0, model={})  # fmt: skip
CONFIGS = {
    "small": {},
    "small-seed1": dict(seed=1),
    "small-seed2": dict(seed=2),
    "deep6": dict(model=dict(num_layers=6)),
    "deep6-drop02-att0": dict(model=dict(num_layers=6), dropout=0.2, attention_dropout=0.0),
    "deep4": dict(model=dict(num_layers=4)),
    "drop02-att0": dict(dropout=0.2, attention_dropout=0.0),
    "ls02": dict(label_smoothing=0.2),
    "prenorm-lr2": dict(model=dict(normalize_first=True), lr_mult=2.0),
    "deep6-prenorm-lr2": dict(model=dict(num_layers=6, normalize_first=True), lr_mult=2.0),
    "d384-ff1536-drop03-att0": dict(
        model=dict(hidden_dim=384, intermediate_dim=1536, num_heads=6),
        dropout=0.3,
        attention_dropout=0.0,
    ),
    "tiny-fairseq": dict(
        model=dict(num_layers=4, hidden_dim=128, intermediate_dim=256, num_heads=4),
        dropout=0.3,
        attention_dropout=0.0,
        lr_mult=2.0,
    ),
    "ff2048": dict(model=dict(intermediate_dim=2048)),
    "tok1536-lr15": dict(tokens=1536, lr_mult=1.5),
    "heads8": dict(model=dict(num_heads=8)),
    "deep4-prenorm": dict(model=dict(num_layers=4, normalize_first=True)),
    "deep6-prenorm": dict(model=dict(num_layers=6, normalize_first=True)),
    "ls005": dict(label_smoothing=0.05),
    # R-Drop (`train --rdrop-alpha 5`): every sentence twice per batch.
    "rdrop5": dict(rdrop=5.0),
    "rdrop5-seed1": dict(rdrop=5.0, seed=1),
    "rdrop5-seed2": dict(rdrop=5.0, seed=2),
    "rdrop5-drop02-att0": dict(rdrop=5.0, dropout=0.2, attention_dropout=0.0),
    "rdrop5-drop03-att0": dict(rdrop=5.0, dropout=0.3, attention_dropout=0.0),
    "rdrop5-ff2048": dict(rdrop=5.0, model=dict(intermediate_dim=2048)),
    # The seed spread of the wider layer's lead, and a wider one still.
    "rdrop5-ff2048-seed1": dict(rdrop=5.0, seed=1, model=dict(intermediate_dim=2048)),
    "rdrop5-ff2048-seed2": dict(rdrop=5.0, seed=2, model=dict(intermediate_dim=2048)),
    "rdrop5-ff3072": dict(rdrop=5.0, model=dict(intermediate_dim=3072)),
    "rdrop10": dict(rdrop=10.0),
}


def setting(name: str) -> dict:
    if name not in CONFIGS:
        raise SystemExit(f"unknown setting {name!r}; known: {', '.join(CONFIGS)}")
    return {**BASE, **CONFIGS[name], "name": name}


# --- prepare (this machine) -------------------------------------------------


def prepare(args) -> None:
    """Copies the pair's text and a SentencePiece model into `args.out`, for carrying."""
    src, tgt = args.pair
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "val", TEST):
        for lang in (src, tgt):
            name = f"{split}.{lang}.gz"
            shutil.copyfile(os.path.join(args.data, name), os.path.join(args.out, name))
    target = os.path.join(args.out, f"spm-{src}-{tgt}.model")
    if args.spm:
        shutil.copyfile(args.spm, target)
    else:
        from keras_transformer.data.pipeline import read_lines
        from keras_transformer.data.tokenizer import train_sentencepiece

        texts = read_lines(os.path.join(args.data, f"train.{src}.gz"))
        texts += read_lines(os.path.join(args.data, f"train.{tgt}.gz"))
        train_sentencepiece(texts, args.vocab_size).save(target)
    print(f"wrote {args.out}: text of {src}-{tgt} and {target}")


# --- one setting (a child process) ------------------------------------------


class Batches:
    """`keras-transformer train`'s length-bucketed batches, padded to `WIDTHS` shapes."""

    def __init__(self, source_ids, target_ids, tokens, max_length, seed, twice=False):
        from keras_transformer.data.pipeline import _batch_sizes, bucket_boundaries

        self.source_ids, self.target_ids = source_ids, target_ids
        self.boundaries = bucket_boundaries(max_length)
        self.sizes = _batch_sizes(self.boundaries, tokens)
        self.keys = [max(len(s), len(t)) + 1 for s, t in zip(source_ids, target_ids, strict=True)]
        self.bucket = np.searchsorted(self.boundaries, self.keys)
        self.rng = np.random.default_rng(seed)
        # Rows of every padded batch: the most sentences any bucket batches.
        self.rows = max(self.sizes)
        # R-Drop: each sentence in two adjacent rows, as `duplicate_rows` makes them.
        self.twice = twice

    @staticmethod
    def width(length):
        return next((w for w in WIDTHS if w >= length), length)

    def epoch(self):
        """One pass of padded `(inputs, labels)` batches."""
        for members in self.epoch_members():
            yield self.pad(members)

    def epoch_members(self):
        """One pass as lists of pair indices: bucket batches in shuffled order, as
        tf.data's bucketing makes them (a batch leaves when its bucket fills)."""
        order = self.rng.permutation(len(self.source_ids))
        open_batches, batches = {}, []
        for i in order:
            b = int(self.bucket[i])
            open_batches.setdefault(b, []).append(i)
            if len(open_batches[b]) == self.sizes[b]:
                batches.append(open_batches.pop(b))
        batches += [v for v in open_batches.values() if v]
        self.rng.shuffle(batches)
        return batches

    def pad(self, members):
        from keras_transformer_runtime.specials import BOS_ID, EOS_ID

        longest = max(max(len(self.source_ids[i]), len(self.target_ids[i])) + 1 for i in members)
        width = self.width(longest)
        src = np.zeros((self.rows, width), np.int32)
        dec = np.zeros((self.rows, width), np.int32)
        lab = np.zeros((self.rows, width), np.int32)
        for r, i in enumerate(members):
            s, t = self.source_ids[i], self.target_ids[i]
            src[r, : len(s) + 1] = [*s, EOS_ID]
            dec[r, : len(t) + 1] = [BOS_ID, *t]
            lab[r, : len(t) + 1] = [*t, EOS_ID]
        if self.twice:
            src, dec, lab = (np.repeat(a, 2, axis=0) for a in (src, dec, lab))
        return {"source_ids": src, "target_ids": dec}, lab

    def count(self):
        from keras_transformer.data.pipeline import _count_batches

        return _count_batches(self.keys, self.boundaries, self.sizes)


def _read_split(data, split, src, tgt):
    from keras_transformer.data.pipeline import read_lines

    return read_lines(os.path.join(data, f"{split}.{src}.gz")), read_lines(
        os.path.join(data, f"{split}.{tgt}.gz")
    )


def _mean_weights(kept, epochs):
    """The element-wise mean of the weights kept after `epochs`."""
    return [np.mean(values, axis=0) for values in zip(*(kept[e] for e in epochs), strict=True)]


def run_one(args) -> None:
    import keras

    from keras_transformer.config import TransformerConfig
    from keras_transformer.data.tokenizer import SentencePieceTokenizer
    from keras_transformer.evaluation import score_translations
    from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedAccuracy
    from keras_transformer.model import build_transformer
    from keras_transformer.schedules import transformer_optimizer
    from keras_transformer.train.checkpoints import final_candidates
    from keras_transformer.train.settings import (
        KEEP_CHECKPOINTS,
        PAPER_WARMUP_STEPS,
        WARMUP_EPOCHS,
    )
    from keras_transformer.translation import translate_lines

    s = setting(args.one)
    if args.epochs:
        s["epochs"] = args.epochs
    src, tgt = args.pair
    tokenizer = SentencePieceTokenizer.load(os.path.join(args.data, f"spm-{src}-{tgt}.model"))
    config = TransformerConfig.from_preset(
        s["preset"],
        vocabulary_size=tokenizer.vocabulary_size,
        dropout=s["dropout"],
        attention_dropout=s["attention_dropout"],
        **s["model"],
    )
    sources, targets = _read_split(args.data, "train", src, tgt)
    limit = args.max_sentences or len(sources)
    src_ids, tgt_ids = [], []
    for a, b in zip(sources[:limit], targets[:limit], strict=True):
        if not (a.strip() and b.strip()):
            continue
        x, y = tokenizer.encode(a), tokenizer.encode(b)
        if len(x) + 1 <= config.max_length and len(y) + 1 <= config.max_length:
            src_ids.append(x)
            tgt_ids.append(y)
    batches = Batches(
        src_ids, tgt_ids, s["tokens"], config.max_length, s["seed"], twice=bool(s["rdrop"])
    )
    per_epoch = batches.count()
    # `TrainSettings.schedule`'s automatic warm-up and peak, times `lr_mult`.
    warmup = min(PAPER_WARMUP_STEPS, WARMUP_EPOCHS * per_epoch)
    scale = math.sqrt(warmup / PAPER_WARMUP_STEPS) * s["lr_mult"]

    keras.utils.set_random_seed(s["seed"])
    model = build_transformer(config)
    model.compile(
        optimizer=transformer_optimizer(config.hidden_dim, warmup, scale),
        loss=LabelSmoothedCrossEntropy(s["label_smoothing"], consistency=s["rdrop"]),
        metrics=[MaskedAccuracy()],
        steps_per_execution=args.steps_per_execution,
    )
    val = _read_split(args.data, "val", src, tgt)
    test = _read_split(args.data, TEST, src, tgt)
    if args.max_sentences:
        val = (val[0][: args.max_sentences], val[1][: args.max_sentences])
        test = (test[0][: args.max_sentences], test[1][: args.max_sentences])
    val_batches = Batches(
        [tokenizer.encode(t) for t in val[0]], [tokenizer.encode(t) for t in val[1]],
        2048, config.max_length, 0, twice=bool(s["rdrop"]),
    )  # fmt: skip

    def bleu(split, beam=1, alpha=0.6):
        hyps = translate_lines(
            model, tokenizer, split[0], beam_size=beam, length_penalty=alpha, batch_size=1024
        )
        return score_translations(hyps, split[1])

    report = dict(setting=s, updates_per_epoch=per_epoch, warmup=warmup, scale=scale,
                  parameters=model.count_params(), epochs=[], started=time.time())  # fmt: skip

    def write():
        with open(args.report + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.report + ".tmp", args.report)

    kept = {}
    for epoch in range(1, s["epochs"] + 1):
        if args.deadline and time.time() - report["started"] > args.deadline:
            report["stopped"] = f"deadline of {args.deadline} s reached before epoch {epoch}"
            break
        t0 = time.time()
        members = batches.epoch_members()
        # fit, not train_on_batch: with steps_per_execution the device runs ahead
        # of Python instead of waiting for each step's loss.
        history = model.fit(
            (batches.pad(m) for m in members),
            steps_per_epoch=len(members),
            epochs=epoch,
            initial_epoch=epoch - 1,
            verbose=0,
        )
        train_seconds = time.time() - t0
        val_losses, val_tokens = [], []
        for x, y in val_batches.epoch():
            logs = model.test_on_batch(x, y, return_dict=True)
            val_losses.append(float(logs["loss"]))
            val_tokens.append(int((y != 0).sum()))
        entry = dict(
            epoch=epoch,
            train_loss=float(history.history["loss"][-1]),
            val_loss=float(np.average(val_losses, weights=val_tokens)),
            seconds=round(train_seconds, 1),
        )
        if epoch >= args.bleu_from:
            scores = bleu(val)
            entry.update(val_bleu=scores["bleu"], val_bleu_lowercase=scores["bleu_lowercase"])
            kept[epoch] = [w.copy() for w in model.get_weights()]
        report["epochs"].append(entry)
        write()
        print(f"[{s['name']}] {json.dumps(entry)}", flush=True)

    # Final weights as `train --final auto` chooses them: means of the last and
    # of the best k epochs, k up to train's default `average`, by greedy val BLEU.
    if not kept:  # stopped before any epoch was scored: the last weights
        kept[len(report["epochs"])] = [w.copy() for w in model.get_weights()]
    candidates = final_candidates(report["epochs"], list(kept), "bleu", KEEP_CHECKPOINTS)
    finals = []
    for label, epochs in candidates.items():
        model.set_weights(_mean_weights(kept, epochs))
        scores = bleu(val)
        finals.append(dict(label=label, epochs=list(epochs), val_bleu=scores["bleu"],
                           val_bleu_lowercase=scores["bleu_lowercase"]))  # fmt: skip
        report["finals"] = finals
        write()
    best = max(finals, key=lambda f: f["val_bleu"])
    model.set_weights(_mean_weights(kept, best["epochs"]))
    report["final"] = best
    report["final"]["val_beam5"] = bleu(val, beam=5)
    write()
    report["final"]["test_greedy"] = bleu(test)
    report["final"]["test_beam5"] = bleu(test, beam=5)
    report["seconds"] = round(time.time() - report["started"], 1)
    write()
    print(f"[{s['name']}] final {json.dumps(report['final'])}", flush=True)


# --- many settings at once --------------------------------------------------


def run_many(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "sweep.log"), "w")
    work = os.path.join(args.work, "reports")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", KERAS_BACKEND="jax")
    children = {}
    for name in args.configs:
        setting(name)
        report = os.path.join(work, f"{name}.json")
        command = [sys.executable, "-m", "benchmarks.recipe_sweep", "one", name,
                   "--data", args.data, "--pair", *args.pair, "--report", report,
                   "--bleu-from", str(args.bleu_from)]  # fmt: skip
        for flag in ("max_sentences", "epochs", "deadline", "steps_per_execution"):
            if getattr(args, flag):
                command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        children[name] = (
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env),
            report,
        )

    machine = _machine()

    def merge():
        merged = {"pair": args.pair, "machine": machine, "settings": {}}
        for name, (process, report) in children.items():
            entry = {"returncode": process.poll()}
            if os.path.exists(report):
                with open(report) as f:
                    entry.update(json.load(f))
            merged["settings"][name] = entry
        path = os.path.join(args.out, "sweep.json")
        with open(path + ".tmp", "w") as f:
            json.dump(merged, f, indent=1)
        os.replace(path + ".tmp", path)
        return merged

    while any(p.poll() is None for p, _ in children.values()):
        time.sleep(10)
        merge()
        log.flush()
    merged = merge()
    for name, entry in merged["settings"].items():
        final = entry.get("final", {})
        print(name, entry["returncode"], final.get("val_bleu"), final.get("val_beam5", {}).get("bleu_lowercase"),
              final.get("test_beam5", {}).get("bleu_lowercase"))  # fmt: skip


def _machine() -> dict:
    """`benchmarks.machine.describe_machine`, with the GPU and JAX's version."""
    from benchmarks.machine import describe_machine

    os.environ.setdefault("KERAS_BACKEND", "jax")  # the device has no TensorFlow
    info = describe_machine()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        info["gpu"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    try:
        import jax

        info["jax"] = jax.__version__
    except ImportError:
        info["jax"] = None
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--pair", nargs=2, default=["en", "de"])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--spm", help="the CPU run's spm.model (default: train one as `train` does)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--out", required=True)
    for name in ("run", "one"):
        p = sub.add_parser(name)
        if name == "one":
            p.add_argument("one")
            p.add_argument("--report", required=True)
        else:
            p.add_argument("--configs", nargs="+", required=True)
            p.add_argument("--out", required=True)
            p.add_argument("--work", default="/tmp/recipe_sweep")
        p.add_argument("--data", required=True)
        p.add_argument("--pair", nargs=2, default=["en", "de"])
        p.add_argument("--bleu-from", type=int, default=8)
        p.add_argument("--max-sentences", type=int, help="a quick check: the first N of each split")
        p.add_argument("--steps-per-execution", type=int, default=32)
        p.add_argument("--epochs", type=int, help="instead of the setting's")
        p.add_argument("--deadline", type=float,
                       help="seconds after which no new epoch starts; the final choice still runs")  # fmt: skip
    args = parser.parse_args(argv)
    {"prepare": prepare, "run": run_many, "one": run_one}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
