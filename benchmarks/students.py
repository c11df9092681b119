"""Students beside their teacher: BLEU, speed and size of each model, with its shortlist and
without, and CTranslate2 on the same weights (with the same list as its vmap).

    python -m benchmarks.students NAME=RUN [NAME=RUN ...] [--export onnx-shortlist]
        [--data DIR] [--splits test_2016_flickr] [--precisions float32 int8] [--beams 1 4]
        [--batches 32 1] [--threads 1 2] [--parallel 1] [--repeats 2] [--lines N]
        [--batch1-lines N] [--ctranslate2] [--ctranslate2-threads 1] [--out JSON]
    python -m benchmarks.students --table JSON [JSON ...] [--plot PNG]

Each RUN is a run directory (`keras-transformer train`) holding, in its
`--export` folder, an export made with `--precision int8 --shortlist-data`.
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
import gzip
import json
import os
import time

from benchmarks.machine import SHARED_MULTI30K, write_report

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def read(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def run(translator, sources, beam, batch, parallel=1):
    """`(translations, seconds, target pieces)` of one pass over `sources`."""
    from keras_transformer_runtime.options import SearchOptions

    start = time.perf_counter()
    if hasattr(translator, "decoder"):  # ours
        options = SearchOptions(beam_size=beam)
        found = translator.translate_hypotheses(
            sources, options, batch_size=batch, parallel_batches=parallel
        )
        texts = [h[0]["text"] for h in found]
    else:  # CTranslate2 (same batches: sorted by length; length penalty 0.6 in beam search)
        texts = translator.translate(
            sources, beam_size=beam, batch_size=batch, parallel_batches=parallel
        )
    seconds = time.perf_counter() - start
    pieces = sum(len(translator.tokenizer.encode_target(t)) for t in texts)
    return texts, seconds, pieces


def ctranslate2_peers(run_dir, precision, threads, parallel, shortlist, folder):
    """CTranslate2 on the run's own weights, without and with the shortlist as its
    vocabulary map, each in a process of its own."""
    from benchmarks.ctranslate2_peer import CTranslate2Translator, ctranslate2_model, vmap_file
    from keras_transformer.translation import load_run

    model, tokenizer = load_run(run_dir)
    quantization = "int8" if precision == "int8" else None
    out = os.path.join(folder, precision)
    vmap = vmap_file(shortlist, tokenizer, os.path.join(folder, "vmap.txt"))
    ctranslate2_model(model, tokenizer, out, quantization, vmap=vmap)
    settings = dict(
        compute_type=precision, threads=threads, parallel_batches=parallel, isolated=True
    )
    return {
        "ctranslate2": CTranslate2Translator(out, tokenizer, **settings),
        "ctranslate2_vmap": CTranslate2Translator(out, tokenizer, use_vmap=True, **settings),
    }


def describe(export):
    """The model's shape and size, from its export."""
    with open(os.path.join(export, "manifest.json")) as f:
        config = json.load(f)["config"]
    size = {}  # MB of the weights file of each precision exported
    for precision in ("", "_int8"):
        path = os.path.join(export, f"weights{precision}.bin")
        size[precision] = round(os.path.getsize(path) / 1e6, 1) if os.path.isfile(path) else None
    return {
        "encoder_layers": config["num_encoder_layers"],
        "decoder_layers": config["num_decoder_layers"],
        "hidden_dim": config["hidden_dim"],
        "intermediate_dim": config["intermediate_dim"],
        "vocabulary_size": config["vocabulary_size"],
        "weights_mb": size[""],
        "weights_int8_mb": size["_int8"],
    }


def measure_cell(translators, sources, beam, batch, args):
    """`{name: (seconds, pieces, texts)}`: the fastest of `args.repeats` interleaved passes."""
    import numpy as np

    best = {}
    for _ in range(args.repeats):
        for name, translator in translators.items():
            fresh = not hasattr(translator, "translate")
            if fresh:
                translator = translator()
                run(translator, sources[:batch], beam, batch, args.parallel)
            texts, seconds, pieces = run(translator, sources, beam, batch, args.parallel)
            if fresh:
                del translator
                gc.collect()
            if seconds < best.get(name, (np.inf,))[0]:
                best[name] = (seconds, pieces, texts)
    return best


def measure_model(name, run_dir, data, args):
    import tempfile

    import numpy as np
    import sacrebleu
    from keras_transformer_runtime import OnnxTranslator

    export = os.path.join(run_dir, args.export)
    rows = []
    for precision in args.precisions:
        for threads in args.threads:
            translators = {
                "shortlist": lambda t=threads, p=precision: OnnxTranslator(
                    export, num_threads=t, precision=p
                ),
                "full": lambda t=threads, p=precision: OnnxTranslator(
                    export, num_threads=t, precision=p, shortlist=False
                ),
            }
            listed = translators["shortlist"]().decoder  # never searches
            if listed.shortlist is None:
                raise SystemExit(f"{export} was exported without a shortlist.")
            if args.ctranslate2 and threads in args.ctranslate2_threads:
                folder = tempfile.mkdtemp(prefix="ct2-vmap-")
                translators |= ctranslate2_peers(
                    run_dir, precision, threads, args.parallel, listed.shortlist, folder
                )
            for beam in args.beams:
                for batch in args.batches:
                    for split, (sources, references) in data.items():
                        if batch < 8 and args.batch1_lines:
                            sources = sources[: args.batch1_lines]
                            references = references[: args.batch1_lines]
                        best = measure_cell(translators, sources, beam, batch, args)
                        sizes = [
                            listed.shortlist.ids(_batch_ids(listed, sources[i : i + batch])).size
                            for i in range(0, len(sources), batch)
                        ]
                        row = {
                            "model": name,
                            "precision": precision,
                            "threads": threads,
                            "parallel_batches": args.parallel,
                            "beam": beam,
                            "batch": batch,
                            "split": split,
                            "sentences": len(sources),
                            "mean_list_size": float(np.mean(sizes)),
                        }
                        for system, (seconds, pieces, texts) in best.items():
                            bleu = sacrebleu.corpus_bleu(
                                [t.lower() for t in texts], [[r.lower() for r in references]]
                            )
                            row[system] = {
                                "bleu": round(bleu.score, 2),
                                "seconds": seconds,
                                "sentences_per_second": len(sources) / seconds,
                                "target_tokens_per_second": pieces / seconds,
                            }
                        row["speedup"] = row["full"]["seconds"] / row["shortlist"]["seconds"]
                        if "ctranslate2" in row:  # > 1: ours is faster
                            row["ours_over_ctranslate2"] = (
                                row["ctranslate2"]["seconds"] / row["full"]["seconds"]
                            )
                            row["ours_shortlist_over_ctranslate2_vmap"] = (
                                row["ctranslate2_vmap"]["seconds"] / row["shortlist"]["seconds"]
                            )
                        rows.append(row)
                        peer = (
                            f" | CT2 x{row['ours_over_ctranslate2']:.2f}, vmap "
                            f"x{row['ours_shortlist_over_ctranslate2_vmap']:.2f}"
                            if "ctranslate2" in row
                            else ""
                        )
                        print(
                            f"{name:12s} {precision:7s} {args.parallel}x{threads}t beam {beam} "
                            f"batch {batch:3d} {split:16s} list {row['mean_list_size']:5.0f} "
                            f"full {row['full']['sentences_per_second']:7.1f}/s "
                            f"BLEU {row['full']['bleu']:5.2f} | shortlist "
                            f"{row['shortlist']['sentences_per_second']:7.1f}/s "
                            f"BLEU {row['shortlist']['bleu']:5.2f} | {row['speedup']:.2f}x{peer}",
                            flush=True,
                        )
            for translator in translators.values():
                if hasattr(translator, "close"):  # CTranslate2's processes
                    translator.close()
    return rows


def measure(args):
    data = {}
    for split in args.splits:
        sources = read(os.path.join(args.data, f"{split}.{args.src}.gz"))
        references = read(os.path.join(args.data, f"{split}.{args.tgt}.gz"))
        data[split] = (sources[: args.lines], references[: args.lines])
    models, rows = {}, []
    for spec in args.models:
        name, _, run_dir = spec.partition("=")
        if not run_dir:
            raise SystemExit(f"{spec!r}: models are given as NAME=RUN_DIR.")
        models[name] = {"run": run_dir, **describe(os.path.join(run_dir, args.export))}
        rows += measure_model(name, run_dir, data, args)
    return models, rows


def _batch_ids(decoder, sentences):
    """The padded source ids of a batch of `sentences`, as the translator encodes them."""
    import numpy as np
    from keras_transformer_runtime.specials import EOS_ID

    encoded = [decoder.tokenizer.encode(s) + [EOS_ID] for s in sentences]
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
    lines = [
        "| model | layers | d | int8 MB | test greedy | beam 4 | int8 greedy | int8, list "
        f"| val int8, list | int8 greedy {batch}, 1 thread, sent/s: full | list | x teacher "
        "| x CT2 vmap |",
        "| --- " * 13 + "|",
    ]
    for name, model in models.items():
        f32 = _cell(rows, model=name, **{**speed, "precision": "float32"})
        beam = _cell(rows, model=name, **{**speed, "precision": "float32", "beam": 4})
        int8 = _cell(rows, model=name, **speed)
        val = _cell(rows, model=name, precision="int8", beam=1, split="val")

        def get(row, *keys, fmt="{:.2f}"):
            for key in keys:
                if row is None or key not in row:
                    return ""
                row = row[key]
            return fmt.format(row)

        ratio = (
            f"{int8['shortlist']['sentences_per_second'] / reference['full']['sentences_per_second']:.2f}x"
            if int8 and reference
            else ""
        )
        lines.append(
            f"| {name} | {model['encoder_layers']}-{model['decoder_layers']} "
            f"| {model['hidden_dim']} | {model['weights_int8_mb']} "
            f"| {get(f32, 'full', 'bleu')} | {get(beam, 'full', 'bleu')} "
            f"| {get(int8, 'full', 'bleu')} | {get(int8, 'shortlist', 'bleu')} "
            f"| {get(val, 'shortlist', 'bleu')} "
            f"| {get(int8, 'full', 'sentences_per_second', fmt='{:.0f}')} "
            f"| {get(int8, 'shortlist', 'sentences_per_second', fmt='{:.0f}')} | {ratio} "
            f"| {get(int8, 'ours_shortlist_over_ctranslate2_vmap', fmt='{:.2f}x')} |"
        )
    return "\n".join(lines)


def plot(reports, path):
    """BLEU on test against sentences/s on one thread at batch 32: one point per model,
    precision, search and list setting, a colour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from keras_transformer.io_utils import atomic_path

    rows = [r for report in reports for r in report["rows"]]
    split, batch = _test_split(rows), max(r["batch"] for r in rows)
    figure, axes = plt.subplots(figsize=(7, 4.5))
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
    axes.legend(fontsize=8, loc="center right")
    figure.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=110)


def main(argv=None):
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", metavar="NAME=RUN")
    parser.add_argument("--export", default="onnx-shortlist", help="each run's export folder")
    parser.add_argument("--data", default=SHARED_MULTI30K, help="the Multi30k folder")
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
    parser.add_argument("--out", default=os.path.join(RESULTS, "students.json"))
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of reports")
    parser.add_argument("--plot", metavar="PNG", help="with --table: draw the frontier")
    args = parser.parse_args(argv)
    if args.table:
        reports = []
        for path in args.table:
            with open(path) as f:
                reports.append(json.load(f))
        print(table(reports))
        if args.plot:
            plot(reports, args.plot)
        return
    if not args.models:
        parser.error("give NAME=RUN models to measure, or --table JSON")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    models, rows = measure(args)
    write_report("students", args, models=models, rows=rows)


if __name__ == "__main__":
    main()
