"""Students beside their teacher: BLEU, speed and size of each model, with its shortlist and
without, and CTranslate2 on the same weights (with the same list as its vmap).

    python -m benchmarks.students NAME=RUN [NAME=RUN ...] [--export onnx-shortlist]
        [--data DIR] [--splits test_2016_flickr] [--precisions float32 int8] [--beams 1 4]
        [--batches 32 1] [--threads 1 2] [--parallel 1] [--repeats 2] [--lines N]
        [--batch1-lines N] [--ctranslate2] [--ctranslate2-threads 1] [--out JSON]
    python -m benchmarks.students --table JSON [JSON ...] [--plot PNG]

Each RUN is a run directory (`keras-transformer train`) holding, in its
`--export` folder, an export made with `--precision int8 --shortlist-data`,
or another such export folder inside a run (the same model with another
list, say).
The first model is the reference (the teacher) of the speed ratios. Per
model, precision, thread count, beam and batch size, the same translator
settings run with the shortlist (`OnnxTranslator(..., shortlist=None)`, the
default) and without it (`shortlist=False`), their repetitions interleaved;
the fastest repetition counts. Each pass gets a translator of its own,
warmed on one batch, and no other of ours is alive while it runs (ONNX
Runtime's idle threads spin). Lower-cased BLEU (sacreBLEU) of each split,
sentences/s and target tokens/s (the pieces produced, EOS excluded), the
average list size per batch. `--table` prints one markdown row per model
from the reports given (a val report beside the test one adds val BLEU),
and `--plot` draws the speed-quality frontier.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

from benchmarks import harness


def ctranslate2_peers(run_dir, precision, threads, parallel, shortlist, folder):
    """CTranslate2 on the run's own weights, without and with the shortlist as its
    vocabulary map, each in a process of its own."""
    from benchmarks.ctranslate2_peer import CTranslate2Translator, ctranslate2_model, vmap_file
    from keras_transformer.translation import load_run

    model, tokenizer = load_run(run_dir)
    out = os.path.join(folder, precision)
    vmap = vmap_file(shortlist, tokenizer, os.path.join(folder, "vmap.txt"))
    ctranslate2_model(model, tokenizer, out, "int8" if precision == "int8" else None, vmap=vmap)
    settings = dict(compute_type=precision, threads=threads, parallel_batches=parallel)
    return {
        "ctranslate2": CTranslate2Translator(out, tokenizer, isolated=True, **settings),
        "ctranslate2_vmap": CTranslate2Translator(
            out, tokenizer, isolated=True, use_vmap=True, **settings
        ),
    }


def describe(export):
    """The model's shape and size, from its export."""
    with open(os.path.join(export, "manifest.json")) as f:
        config = json.load(f)["config"]
    shape = ("num_encoder_layers", "num_decoder_layers", "hidden_dim", "intermediate_dim")
    described = {k.replace("num_", ""): config[k] for k in shape}
    described["vocabulary_size"] = config["vocabulary_size"]
    for key, precision in (("weights_mb", ""), ("weights_int8_mb", "_int8")):
        path = os.path.join(export, f"weights{precision}.bin")  # MB of each precision exported
        described[key] = round(os.path.getsize(path) / 1e6, 1) if os.path.isfile(path) else None
    return described


def measure_cell(translators, sources, beam, batch, args):
    """`{name: (texts, seconds of each pass)}` over `args.repeats` interleaved passes.

    A translator given as a factory (ours) is built afresh for each pass and
    warmed on one batch, so that no other of ours is alive while it runs
    (ONNX Runtime's idle threads spin)."""
    found = {name: ([], []) for name in translators}
    settings = dict(beam_size=beam, batch_size=batch, parallel_batches=args.parallel)
    for _ in range(args.repeats):
        for name, translator in translators.items():
            fresh = not hasattr(translator, "translate")
            if fresh:
                translator = translator()
                translator.translate(sources[:batch], **settings)
            texts, seconds = harness.timed(translator.translate, sources, **settings)
            found[name] = (texts, found[name][1] + [seconds])
            if fresh:
                del translator
                gc.collect()
    return found


def measure_model(name, run_dir, export, data, args):
    """The rows of one model: per precision, thread count, beam, batch and split."""
    import tempfile

    import numpy as np
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer.evaluation import score_translations

    rows = []
    for precision in args.precisions:
        for threads in args.threads:
            settings = dict(num_threads=threads, precision=precision)
            translators = {
                "shortlist": lambda s=settings: OnnxTranslator(export, **s),
                "full": lambda s=settings: OnnxTranslator(export, shortlist=False, **s),
            }
            listed = translators["shortlist"]()  # never searches
            if listed.decoder.shortlist is None:
                raise SystemExit(f"{export} was exported without a shortlist.")
            if args.ctranslate2 and threads in args.ctranslate2_threads:
                folder = tempfile.mkdtemp(prefix="ct2-vmap-")
                translators |= ctranslate2_peers(
                    run_dir, precision, threads, args.parallel, listed.decoder.shortlist, folder
                )
            for beam in args.beams:
                for batch in args.batches:
                    for split, (sources, references) in data.items():
                        if batch < 8 and args.batch1_lines:
                            sources = sources[: args.batch1_lines]
                            references = references[: args.batch1_lines]
                        sizes = [
                            listed.decoder.shortlist.ids(
                                _batch_ids(listed, sources[i : i + batch])
                            ).size
                            for i in range(0, len(sources), batch)
                        ]
                        row = dict(model=name, precision=precision, threads=threads)
                        row.update(parallel_batches=args.parallel, beam=beam, batch=batch)
                        row.update(split=split, sentences=len(sources))
                        row["mean_list_size"] = float(np.mean(sizes))
                        for system, (texts, seconds) in measure_cell(
                            translators, sources, beam, batch, args
                        ).items():  # the fastest pass counts
                            row[system] = harness.speed(texts, [min(seconds)], listed.tokenizer)
                            row[system]["seconds"] = min(seconds)
                            scores = score_translations(texts, references)
                            row[system]["bleu"] = round(scores["bleu_lowercase"], 2)
                        row["speedup"] = row["full"]["seconds"] / row["shortlist"]["seconds"]
                        if "ctranslate2" in row:  # > 1: ours is faster
                            row["ours_over_ctranslate2"] = (
                                row["ctranslate2"]["seconds"] / row["full"]["seconds"]
                            )
                            row["ours_shortlist_over_ctranslate2_vmap"] = (
                                row["ctranslate2_vmap"]["seconds"] / row["shortlist"]["seconds"]
                            )
                        rows.append(row)
                        print(_progress(row), flush=True)
            harness.close(translators)
    return rows


def _progress(row):
    peer = (
        f" | CT2 x{row['ours_over_ctranslate2']:.2f}, vmap "
        f"x{row['ours_shortlist_over_ctranslate2_vmap']:.2f}"
        if "ctranslate2" in row
        else ""
    )
    full, listed = row["full"], row["shortlist"]
    return (
        f"{row['model']:12s} {row['precision']:7s} {row['parallel_batches']}x{row['threads']}t "
        f"beam {row['beam']} batch {row['batch']:3d} {row['split']:16s} list "
        f"{row['mean_list_size']:5.0f} full {full['sentences_per_second']:7.1f}/s BLEU "
        f"{full['bleu']:5.2f} | shortlist {listed['sentences_per_second']:7.1f}/s BLEU "
        f"{listed['bleu']:5.2f} | {row['speedup']:.2f}x{peer}"
    )


def measure(args):
    data = {
        split: harness.multi30k(args.data, split, args.src, args.tgt, args.lines)
        for split in args.splits
    }
    models, rows = {}, []
    for spec in args.models:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: models are given as NAME=RUN_DIR.")
        run_dir, export = model_paths(path, args)
        models[name] = {"run": path, **describe(export)}
        rows += measure_model(name, run_dir, export, data, args)
    return models, rows


def model_paths(path, args):
    """`(run directory, export folder)` of a model given as a run directory or as an
    export folder inside one (CTranslate2 converts the run's Keras model)."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return os.path.dirname(os.path.normpath(path)), path
    return path, os.path.join(path, args.export)


def _batch_ids(translator, sentences):
    """The padded source ids of a batch of `sentences`, as the translator encodes them."""
    import numpy as np
    from keras_transformer_runtime.specials import EOS_ID

    encoded = [translator.tokenizer.encode(s) + [EOS_ID] for s in sentences]
    ids = np.zeros((len(encoded), max(map(len, encoded))), np.int64)
    for row, sentence in zip(ids, encoded, strict=True):
        row[: len(sentence)] = sentence
    return ids


def _test_split(rows):
    """The split of the speed cells: the first one measured that is not val."""
    return next((r["split"] for r in rows if r["split"] != "val"), rows[0]["split"])


def _cell(rows, **where):
    found = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    return found[0] if found else None


def table(reports):
    """A markdown table, one row per model, from the reports' rows (the first model's
    int8 greedy full-vocabulary speed on one thread at batch 32 is 1.0x)."""
    models, rows = {}, []
    for report in reports:
        models |= report["models"]
        rows += report["rows"]
    batch = max(r["batch"] for r in rows)
    speed = dict(precision="int8", threads=1, batch=batch, beam=1, split=_test_split(rows))
    reference = _cell(rows, model=next(iter(models)), **speed)
    header = ["model", "layers", "d", "int8 MB", "test greedy", "beam 4", "int8 greedy"]
    header += ["int8, list", "val int8, list", f"int8 greedy {batch}, 1 thread, sent/s: full"]
    header += ["list", "x teacher", "x CT2 vmap"]

    def get(row, *keys, fmt="{:.2f}"):
        for key in keys:
            if row is None or key not in row:
                return ""
            row = row[key]
        return fmt.format(row)

    lines = []
    for name, model in models.items():
        f32 = _cell(rows, model=name, **{**speed, "precision": "float32"})
        beam = _cell(rows, model=name, **{**speed, "precision": "float32", "beam": 4})
        int8 = _cell(rows, model=name, **speed)
        val = _cell(rows, model=name, precision="int8", beam=1, split="val")
        rate = "sentences_per_second"
        ratio = (
            f"{int8['shortlist'][rate] / reference['full'][rate]:.2f}x"
            if int8 and reference
            else ""
        )
        layers = model.get("encoder_layers"), model.get("decoder_layers")
        lines.append(
            [name, "{}-{}".format(*layers), model["hidden_dim"], model["weights_int8_mb"]]
            + [get(f32, "full", "bleu"), get(beam, "full", "bleu"), get(int8, "full", "bleu")]
            + [get(int8, "shortlist", "bleu"), get(val, "shortlist", "bleu")]
            + [get(int8, "full", rate, fmt="{:.0f}"), get(int8, "shortlist", rate, fmt="{:.0f}")]
            + [ratio, get(int8, "ours_shortlist_over_ctranslate2_vmap", fmt="{:.2f}x")]
        )
    return harness.markdown(header, lines)


def plot(reports, path):
    """BLEU on test against sentences/s on one thread at batch 32: one point per model,
    precision, search and list setting, a colour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from keras_transformer.io_utils import atomic_path

    rows = [r for report in reports for r in report["rows"]]
    split, batch = _test_split(rows), max(r["batch"] for r in rows)
    figure, axes = plt.subplots(figsize=(8.5, 4.5))
    markers = {(1, "full"): "o", (1, "shortlist"): "s", (4, "full"): "^", (4, "shortlist"): "D"}
    for index, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        label = name
        for (beam, system), marker in markers.items():
            for precision in ("float32", "int8"):
                row = _cell(
                    rows, model=name, precision=precision, threads=1, batch=batch, beam=beam,
                    split=split,
                )  # fmt: skip
                if row is None:
                    continue
                axes.plot(
                    row[system]["sentences_per_second"], row[system]["bleu"], marker=marker,
                    color=f"C{index}", markerfacecolor="none" if precision == "float32" else None,
                    linestyle="", label=label,
                )  # fmt: skip
                label = None
    axes.set_xscale("log")
    axes.set_xlabel(f"sentences/s, 1 thread, batch {batch} (log)")
    axes.set_ylabel(f"BLEU, lower-cased, {split}")
    axes.set_title("circles greedy, triangles beam 4; squares/diamonds with the shortlist;\n"
                   "hollow float32, filled int8", fontsize=9)  # fmt: skip
    axes.grid(alpha=0.3)
    # Beside the axes: the fastest models sit at the right edge.
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def main(argv=None):
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", metavar="NAME=RUN")
    parser.add_argument("--export", default="onnx-shortlist", help="each run's export folder")
    parser.add_argument("--data", default=harness.SHARED_MULTI30K, help="the Multi30k folder")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--splits", nargs="+", default=["test_2016_flickr"])
    parser.add_argument("--precisions", nargs="+", default=["float32", "int8"])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 1])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--parallel", type=int, default=1, help="batches searched at once (parallel_batches)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--ctranslate2",
        action="store_true",
        help="CTranslate2 on each run's weights, without and with the shortlist as its "
        "vocabulary map (vmap), beside ours",
    )
    parser.add_argument("--ctranslate2-threads", nargs="+", type=int, default=[1])
    parser.add_argument("--lines", type=int, default=None, help="the first N lines of each split")
    parser.add_argument(
        "--batch1-lines", type=int, default=None, help="the first N lines for batches under 8"
    )
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "students.json"))
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of reports")
    parser.add_argument("--plot", metavar="PNG", help="with --table: draw the frontier")
    args = parser.parse_args(argv)
    if args.table:
        reports = harness.read_reports(args.table)
        print(table(reports))
        if args.plot:
            plot(reports, args.plot)
        return
    if not args.models:
        parser.error("give NAME=RUN models to measure, or --table JSON")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    models, rows = measure(args)
    harness.write_report("students", args, models=models, rows=rows)


if __name__ == "__main__":
    main()
