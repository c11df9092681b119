"""The Multi30k recipe record: every training run tried, its settings and its scores.

    python -m benchmarks.multi30k record RUN_DIR --name NAME [--data DIR] [--note TEXT]
    python -m benchmarks.multi30k table

`record` scores a finished `keras-transformer train` run on test_2016_flickr
(greedy and beam 5, the hypotheses kept in the run directory) and writes
`benchmarks/results/multi30k/NAME.json`: the settings and the command that
reproduces them, the per-epoch validation curve, how the final weights were
chosen, validation and test scores, training time and the machine. `table`
rewrites `benchmarks/results/multi30k/README.md` from all of them.

A run stopped before it finished (`--stopped "why"`) is recorded from its
`history.json`, without test scores: the validation curve shows what went wrong.

Settings are chosen on `val`; test scores are recorded for every run so that
what did not help is visible too, but never used to choose.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys

from benchmarks import harness

RESULTS = os.path.join(harness.RESULTS, "multi30k")
TEST = "test_2016_flickr"
BEAMS = (1, 5)
DEFAULT_ALPHA = 0.6  # the beam search's length penalty unless a record says otherwise
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _language(path: str) -> str:
    """`de` from `.../train.de.gz`."""
    return os.path.basename(path).removesuffix(".gz").rsplit(".", 1)[-1]


def train_command(settings: dict) -> str:
    """The `keras-transformer train` command of a run's `train_config.json`, defaults left out."""
    from keras_transformer.train.settings import TrainSettings, default_select_by

    defaults = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    defaults["select_by"] = default_select_by(settings.get("strategy", "default"))
    words = ["keras-transformer", "train"]
    for side in ("src", "tgt"):
        for split in ("train", "valid"):
            path = settings[f"{side}_{split}"]
            words += [f"--{side}-{split}", f"$DATA/{os.path.basename(path)}"]
    words += ["--out", "RUN"]
    for name, value in settings.items():
        if name.startswith(("src_", "tgt_")) or value == defaults.get(name, value):
            continue
        if name == "epochs" or value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    return " ".join(words)


def _cpu_flags() -> list[str]:
    from keras_transformer.precision import cpu_flags

    present = cpu_flags()
    return [flag for flag in CPU_FLAGS if flag in present]


def hypotheses_path(run_dir: str, beam: int, length_penalty: float = DEFAULT_ALPHA) -> str:
    """Where `evaluate` keeps the run's test hypotheses of one search (its JSON beside)."""
    alpha = "" if beam == 1 or length_penalty == DEFAULT_ALPHA else f".lp{length_penalty:g}"
    return os.path.join(run_dir, f"{TEST}.beam{beam}{alpha}.hyp")


def _evaluate(
    run_dir: str, data: str, src: str, tgt: str, beam: int, length_penalty: float = DEFAULT_ALPHA
) -> dict:
    """Test scores of the run with `beam` (1 = greedy), computed once and kept in the run."""
    output = hypotheses_path(run_dir, beam, length_penalty)
    if not os.path.isfile(output + ".json"):
        command = [
            sys.executable, "-m", "keras_transformer.cli", "evaluate", run_dir,
            "--beam", str(beam), "--output", output,
            "--length-penalty", str(length_penalty),
            "--src", os.path.join(data, f"{TEST}.{src}.gz"),
            "--ref", os.path.join(data, f"{TEST}.{tgt}.gz"),
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(output + ".json", encoding="utf-8") as f:
        scores = json.load(f)
    return {k: scores[k] for k in ("bleu", "bleu_lowercase", "chrf", "bleu_signature")}


def trained_on(history: list) -> list[dict]:
    """Where the epochs trained, from the device and precision `train` keeps per
    epoch: `[{"device", "precision", "epochs": [first, last]}]`, one entry per
    stretch of consecutive epochs on one device at one precision. Epochs
    trained before `train` kept them have `device` and `precision` None.

    Example:

    >>> history = [{"epoch": 1}] + [
    ...     {"epoch": e, "device": "CPU A", "precision": "float32"} for e in (2, 3)
    ... ]
    >>> for stretch in trained_on(history):
    ...     print(stretch)
    {'device': None, 'precision': None, 'epochs': [1, 1]}
    {'device': 'CPU A', 'precision': 'float32', 'epochs': [2, 3]}
    """
    stretches = []
    for e in history:
        where = {"device": e.get("device"), "precision": e.get("precision")}
        if stretches and all(stretches[-1][k] == v for k, v in where.items()):
            stretches[-1]["epochs"][1] = e["epoch"]
        else:
            stretches.append({**where, "epochs": [e["epoch"], e["epoch"]]})
    return stretches


def _read(run_dir, name):
    with open(os.path.join(run_dir, name), encoding="utf-8") as f:
        return json.load(f)


def record(
    run_dir: str,
    name: str,
    data: str,
    note: str = "",
    stopped: str = "",
    length_penalty: float = DEFAULT_ALPHA,
    **known,
) -> dict:
    """Writes the record of `run_dir`; `stopped` (why) records an unfinished run.

    `length_penalty` is the beam search's alpha of the beam-5 test scores
    (chosen on val; say how in `note`). `known` fills what an unfinished run
    did not write yet (`warmup_steps`, `learning_rate_scale`, and `precision`
    where its epochs do not say it), as its log printed them.
    """
    settings = _read(run_dir, "train_config.json")
    src, tgt = _language(settings["src_train"]), _language(settings["tgt_train"])
    if stopped:
        history = _read(run_dir, "history.json")
        metrics = {"history": history, "epochs": len(history), "steps": history[-1]["steps"]}
        metrics["train_seconds"] = sum(e["seconds"] for e in history)
        precisions = {e.get("precision") for e in history}
        if len(precisions) == 1:  # None where train did not record it per epoch yet
            metrics["precision"] = precisions.pop()
        metrics.update(known)
        test = None
    else:
        metrics = _read(run_dir, "metrics.json")
        test = {f"beam{b}": _evaluate(run_dir, data, src, tgt, b, length_penalty) for b in BEAMS}
        test["beam_length_penalty"] = length_penalty
    curve = [
        {k: e[k] for k in ("epoch", "loss", "val_loss", "val_bleu", "seconds") if k in e}
        for e in metrics["history"]
    ]
    entry = {
        "name": name,
        "direction": f"{src}-{tgt}",
        "note": note,
        "stopped": stopped or None,
        "command": train_command(settings),
        "settings": {k: v for k, v in settings.items() if not k.startswith(("src_", "tgt_"))},
        "model": metrics.get("config") or _model_config(settings),
        "precision": metrics.get("precision"),
        "epochs": metrics["epochs"],
        "steps": metrics["steps"],
        "train_minutes": round(metrics["train_seconds"] / 60, 1),
        "warmup_steps": metrics.get("warmup_steps"),
        "learning_rate_scale": metrics.get("learning_rate_scale"),
        "cooldown_steps": metrics.get("cooldown_steps"),
        "tokens_per_batch": metrics.get("tokens_per_batch", settings.get("tokens_per_batch")),
        "final": metrics.get("final", {"chosen": metrics.get("averaged_checkpoints")}),
        "valid": None
        if stopped
        else {
            "bleu": metrics["valid_bleu"],
            "bleu_lowercase": metrics["valid_bleu_lowercase"],
            "chrf": metrics["valid_chrf"],
            "beam": metrics["valid_beam"],
        },
        "validation_curve": curve,
        "test_2016_flickr": test,
        "trained_on": trained_on(metrics["history"]),
        # Where the record was written and test scored.
        "machine": {**harness.describe_machine(), "cpu_flags": _cpu_flags()},
    }
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entry, f, indent=2)
        f.write("\n")
    print(f"Wrote {path}")
    return entry


def _model_config(settings: dict) -> dict:
    from keras_transformer.train.settings import SHAPE_FIELDS, preset_config

    config = preset_config(
        settings["preset"],
        settings["vocab_size"],
        settings.get("dropout"),
        settings.get("attention_dropout"),
        settings.get("normalize_first"),
        **{name: settings.get(name) for name in SHAPE_FIELDS},
    )
    return config.to_dict()


def _summary(settings: dict, model: dict, tokens_per_batch=None) -> str:
    shape = f"{model['num_layers']}L d{model['hidden_dim']} ff{model['intermediate_dim']}"
    parts = [
        f"{settings.get('preset')} ({shape}{', pre-norm' if model['normalize_first'] else ''})",
        f"vocab {settings.get('vocab_size')}",
        f"drop {model['dropout']}",
        f"ls {settings.get('label_smoothing')}",
        f"tok {settings.get('tokens_per_batch') or f'auto ({tokens_per_batch})'}"
        + (f"x{settings['accumulate_steps']}" if settings.get("accumulate_steps", 1) > 1 else ""),
    ]
    if model.get("attention_dropout") not in (None, model["dropout"]):
        parts[2] += f" (attention {model['attention_dropout']})"
    if settings.get("cooldown"):
        parts.append(f"cool-down {settings['cooldown']:g}")
    if settings.get("subword_alpha"):
        nbest = settings.get("subword_nbest", 64)
        parts.append(
            f"subword sampling alpha {settings['subword_alpha']:g} "
            + ("all" if nbest == -1 else f"{nbest}-best")
        )
    if settings.get("rdrop_alpha"):
        parts.append(f"R-Drop alpha {settings['rdrop_alpha']:g}")
    return ", ".join(parts)


def _where(entry: dict) -> str:
    """The table's CPU cell: where the epochs say they trained (each stretch of
    epochs where that changed), else the machine that wrote the record."""
    here = f"{entry['machine']['cpu']} ({', '.join(entry['machine']['cpu_flags'])})"
    stretches = [s for s in entry.get("trained_on", []) if s["device"]]
    if not stretches:
        return here
    if len(entry["trained_on"]) == 1:  # one machine throughout
        return f"{stretches[0]['device']}, {stretches[0]['precision']}"
    cells = []
    for s in entry["trained_on"]:
        first, last = s["epochs"]
        epochs = f"epoch {first}" if first == last else f"epochs {first}-{last}"
        cells.append(
            f"{epochs}: {s['device']}, {s['precision']}"
            if s["device"]
            else f"{epochs}: not recorded"
        )
    return "; ".join(cells)


def table() -> str:
    entries = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path, encoding="utf-8") as f:
            entries.append(json.load(f))
    lines = [
        "# Multi30k recipe record",
        "",
        "Every run tried, written by `python -m benchmarks.multi30k record RUN --name NAME`;",
        "each JSON file holds the full settings, the command, the validation curve and the",
        "machine. Settings are chosen on val; test_2016_flickr is reported for every run.",
        "BLEU: sacreBLEU 13a, `lower` = lowercase=True. A note may quote",
        "`examples/multi30k.sh` with the defaults it had when the run was made; the",
        "`command` field is the exact `train` command to rerun.",
        "",
        "| run | dir | settings | warm-up, peak scale | epochs | minutes | final | val BLEU "
        "| test greedy lower | test beam 5 lower / cased / chrF | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in sorted(entries, key=lambda e: (e["direction"], e["name"])):
        scale = e.get("learning_rate_scale")
        if e.get("stopped"):
            last = e["validation_curve"][-1]
            final = f"stopped: {e['stopped']}"
            scores = f"(val loss {last['val_loss']:.3f}) | - | -"
        else:
            greedy, beam = e["test_2016_flickr"]["beam1"], e["test_2016_flickr"]["beam5"]
            final = e["final"].get("chosen") if isinstance(e["final"], dict) else e["final"]
            alpha = e["test_2016_flickr"].get("beam_length_penalty", DEFAULT_ALPHA)
            scores = (
                f"{e['valid']['bleu']} | {greedy['bleu_lowercase']} "
                f"| {beam['bleu_lowercase']} / {beam['bleu']} / {beam['chrf']}"
                + ("" if alpha == DEFAULT_ALPHA else f" (length penalty {alpha:g})")
            )
        lines.append(
            f"| {e['name']} | {e['direction']} | {_summary(e['settings'], e['model'], e.get('tokens_per_batch'))} "
            f"| {e.get('warmup_steps')}, {scale if scale is None else round(scale, 3)} "
            f"| {e['epochs']} | {e['train_minutes']} | {final} | {scores} | {_where(e)} |"
        )
    notes = [f"- **{e['name']}**: {e['note']}" for e in entries if e.get("note")]
    if notes:
        lines += ["", *notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi30k", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="score a finished run on test and record it")
    rec.add_argument("run_dir")
    rec.add_argument("--name", required=True, help="the record's file name (no extension)")
    rec.add_argument("--data", default=os.environ.get("MULTI30K", harness.SHARED_MULTI30K))
    rec.add_argument("--note", default="", help="what the run tried, in a few words")
    rec.add_argument("--stopped", default="", help="why an unfinished run was stopped")
    rec.add_argument("--warmup-steps", type=int, help="an unfinished run's printed warm-up")
    rec.add_argument("--learning-rate-scale", type=float, help="its printed scale")
    rec.add_argument("--precision", help="its printed precision")
    rec.add_argument(
        "--length-penalty",
        type=float,
        default=DEFAULT_ALPHA,
        help=f"alpha of the beam-5 test scores, chosen on val (default {DEFAULT_ALPHA})",
    )
    sub.add_parser("table", help="rewrite the README table from the records")
    args = parser.parse_args(argv)
    if args.command == "record":
        finished = os.path.isfile(os.path.join(args.run_dir, "metrics.json"))
        if not finished and not args.stopped:
            raise SystemExit(
                f"error: {args.run_dir} has no metrics.json: training is not finished "
                '(record it with --stopped "why" if it was stopped on purpose).'
            )
        known = {
            k: getattr(args, k)
            for k in ("warmup_steps", "learning_rate_scale", "precision")
            if getattr(args, k) is not None
        }
        if not args.length_penalty >= 0:
            raise SystemExit("error: --length-penalty must be a non-negative number.")
        record(
            args.run_dir,
            args.name,
            args.data,
            args.note,
            args.stopped,
            length_penalty=args.length_penalty,
            **known,
        )
    print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
