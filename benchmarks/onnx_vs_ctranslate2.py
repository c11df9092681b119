"""ONNX Runtime against CTranslate2 on the same weights: float32 and int8, greedy and beam 4.

    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --src test.de.gz --ref test.en.gz
    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --src ... --ref ... --options nbest,score
    python -m benchmarks.onnx_vs_ctranslate2 combine A.json B.json C.json
    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --marian-hf HF_DIR --src ... --cells beam4-32

The run is exported afresh (RUN_DIR/onnx-int8) and converted to CTranslate2
float32 and int8 (RUN_DIR/ct2-*, `benchmarks.ctranslate2_peer`; with
`--marian-hf`, CTranslate2 converts the Hugging Face checkpoint itself).
Each cell (search x batch size), or with `--options` each output option
beside the plain beam-4 search at batch 32, runs on every system with the
repetitions interleaved; medians, ratios to CTranslate2 at the same
precision, outputs identical to ONNX Runtime float32, BLEU. The options
(`--threads`, `--parallel-batches`, `--whole-batches`, `--output-length`)
give both systems the same cores and work: see their help and
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

from benchmarks import harness

CELLS = (("greedy", 1, 1), ("greedy", 1, 32), ("beam 4", 4, 1), ("beam 4", 4, 32))
# The names --cells takes: "greedy-32", "beam4-32" (CTranslate2's own protocol), ...
CELL_NAMES = {
    f"{label.replace(' ', '')}-{batch}": (label, beam, batch) for label, beam, batch in CELLS
}
SYSTEMS = ("ort-float32", "ort-int8", "ct2-float32", "ct2-int8")
PEER = {"ort-float32": "ct2-float32", "ort-int8": "ct2-int8"}
# --options: each output option as both systems are asked for it, at beam 4
# (ours: `SearchOptions` fields or `OnnxTranslator.score`; CTranslate2's
# `translate_batch` arguments or `score_batch`).
OPTIONS = {
    "nbest": ({"n_best": 4}, {"num_hypotheses": 4, "return_scores": True}),
    # CTranslate2 returns no per-token scores from a search: its sequence score.
    "scores": ({"token_scores": True}, {"return_scores": True}),
    "alignment": ({"alignment": True}, {"return_attention": True}),
    "score": (None, None),  # forced decoding of the references
}
OPTIONS_BEAM, OPTIONS_BATCH = 4, 32


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.onnx_vs_ctranslate2")
    add = parser.add_argument
    add("run_dir", help="a trained run (model.keras and spm.model)")
    add("--src", required=True, help="source sentences (plain or .gz)")
    add("--ref", help="references, for BLEU")
    add("--lines", type=int, default=200, help="first N sentences (default 200)")
    add("--threads", type=int, default=2, help="intra-op threads of each search, both systems")
    add(
        "--parallel-batches",
        type=int,
        default=1,
        help="batches searched at once, both systems (ORT: parallel_batches; CT2: "
        "inter_threads); the cores used are --threads x --parallel-batches (default 1)",
    )
    add(
        "--whole-batches",
        action="store_true",
        help="ONNX Runtime searches each batch whole on --threads threads "
        "(split_batches=False), not one part per thread",
    )
    add(
        "--marian-hf",
        help="a Hugging Face MarianMT directory that RUN_DIR was imported from: CTranslate2 "
        "converts it with its TransformersConverter instead of our weights' spec",
    )
    add("--repeats", type=int, default=3, help="interleaved repetitions")
    add(
        "--output-length",
        type=int,
        help="every output exactly this many tokens in both systems (minimum and maximum "
        "length): the same work whatever the model says, for a model not trained to "
        "sensible lengths",
    )
    add(
        "--cells",
        type=lambda text: tuple(CELL_NAMES[n] for n in _names(text, CELL_NAMES, "cell")),
        default=CELLS,
        help="comma-separated searches to run, of " + ", ".join(CELL_NAMES) + " (default: all)",
    )
    add(
        "--options",
        type=lambda text: _names(text, OPTIONS, "option"),
        default=argparse.SUPPRESS,  # absent from the default run's settings
        help="comma-separated output options to measure at beam 4, batch 32, beside the "
        "plain search, in place of the cells: " + ", ".join(OPTIONS) + " (score needs --ref)",
    )
    add("--out", help="the JSON report (default: benchmarks/results/...)")
    return parser


def _names(text, known, kind):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {kind} {', '.join(unknown) or text!r}; choose from {', '.join(known)}"
        )
    return tuple(dict.fromkeys(names))


def _systems(args, tokenizer, model):
    """The four systems of `SYSTEMS` and their sizes on disk: ONNX Runtime on the run's
    fresh export, CTranslate2 on the same weights (or on --marian-hf's checkpoint)."""
    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.ctranslate2_peer import CTranslate2Translator, ctranslate2_model
    from keras_transformer.export.forced_graph import FORCED_GRAPHS
    from keras_transformer.export.onnx import export_onnx

    # Exported afresh every time: a folder left by older code would otherwise
    # be measured in place of the graphs this code writes.
    onnx_dir = os.path.join(args.run_dir, "onnx-int8")
    export_onnx(args.run_dir, onnx_dir, precision="int8", overwrite=True)
    systems, sizes = {}, {}
    for precision in ("float32", "int8"):
        ours = systems[f"ort-{precision}"] = OnnxTranslator(
            onnx_dir,
            providers=["CPUExecutionProvider"],
            num_threads=args.threads,
            precision=precision,
            split_batches=False if args.whole_batches else None,
        )
        graphs = ours.manifest["graphs"]  # the teacher-forced graphs do not translate
        files = [g[precision] for key, g in graphs.items() if key not in FORCED_GRAPHS]
        files.append(ours.manifest["weights"][precision])  # their weights, stored once
        sizes[f"ort-{precision}"] = sum(os.path.getsize(os.path.join(onnx_dir, f)) for f in files)
        quantization = None if precision == "float32" else "int8"
        folder = os.path.join(args.run_dir, f"ct2-{precision}")
        if args.marian_hf is not None:
            import ctranslate2

            folder = os.path.join(args.run_dir, f"ct2-marian-{precision}")
            converter = ctranslate2.converters.TransformersConverter(args.marian_hf)
            converter.convert(folder, quantization=quantization, force=True)
        elif not os.path.isfile(os.path.join(folder, "model.bin")):
            ctranslate2_model(model, tokenizer, folder, quantization)
        # Each in a process of its own: see CTranslate2Translator.
        systems[f"ct2-{precision}"] = CTranslate2Translator(
            folder, tokenizer, precision, args.threads, args.parallel_batches, isolated=True
        )
        sizes[f"ct2-{precision}"] = os.path.getsize(os.path.join(folder, "model.bin"))
    return systems, sizes


def _translate(args, name, system, lines, beam, batch):
    """`system.translate` of `lines`, with every output `args.output_length` tokens long
    where that is given."""
    settings = dict(batch_size=batch, parallel_batches=args.parallel_batches)
    length = args.output_length
    if length is None:
        return system.translate(lines, beam_size=beam, **settings)
    if name.startswith("ort"):  # ours: EOS suppressed, `length` tokens at most
        from keras_transformer_runtime.options import SearchOptions
        from keras_transformer_runtime.specials import EOS_ID

        options = SearchOptions(beam, max_length=length, suppress_sequences=((EOS_ID,),))
        return system.translate(lines, options=options, **settings)
    return system.translate(
        lines, beam_size=beam, min_decoding_length=length, max_decoding_length=length, **settings
    )


def _request(args, name, system, option, lines, references):
    """What `option` ("plain" or one of `OPTIONS`) asks of `system`, at beam 4, batch 32."""
    from keras_transformer_runtime.options import SearchOptions

    batch, parallel = OPTIONS_BATCH, args.parallel_batches
    if option == "plain":
        return system.translate(
            lines, beam_size=OPTIONS_BEAM, batch_size=batch, parallel_batches=parallel
        )
    if option == "score":
        return system.score(lines, references, batch_size=batch)
    ours, theirs = OPTIONS[option]
    if name.startswith("ort"):
        options = SearchOptions(beam_size=OPTIONS_BEAM, **ours)
        return system.translate_hypotheses(lines, options, batch_size=batch)
    return system.translate_hypotheses(
        lines, OPTIONS_BEAM, batch, parallel_batches=parallel, **theirs
    )


def run(args):
    """Every cell (or, with --options, every option) on every system: one report."""
    from keras_transformer.evaluation import score_translations
    from keras_transformer.export.onnx import float32_copy
    from keras_transformer.translation import load_run

    lines = harness.read_lines(args.src, args.lines)
    references = harness.read_lines(args.ref, args.lines) if args.ref else None
    model, tokenizer = load_run(args.run_dir)
    systems, sizes = _systems(args, tokenizer, float32_copy(model))
    options = getattr(args, "options", None)
    rows = ("plain", *options) if options else args.cells

    def call(row, name):
        if options:
            return _request(args, name, systems[name], row, lines, references)
        return _translate(args, name, systems[name], lines, row[1], row[2])

    # Every row and system in each round, so that drift slows them alike.
    runs = {(row, name): functools.partial(call, row, name) for row in rows for name in SYSTEMS}
    measured = harness.interleaved(runs, args.repeats)
    harness.close(systems)
    entries = []
    for row in rows:
        entry = (
            {"option": row}
            if options
            else dict(zip(("search", "beam_size", "batch_size"), row, strict=True))
        )
        entry["systems"] = {}
        for name in SYSTEMS:
            seconds, found = measured[row, name]
            if not options:
                result = harness.speed(found, seconds, tokenizer)
                plain = measured[row, "ort-float32"][1]
                result["identical_to_ort_float32"] = sum(
                    a == b for a, b in zip(found, plain, strict=True)
                )
                if references is not None:
                    scores = score_translations(found, references)
                    result.update({k: scores[k] for k in ("bleu", "bleu_lowercase", "chrf")})
                if name.startswith("ort"):  # the searches a full batch runs as
                    result["split_parts"] = systems[name].decoder.split_parts(row[2], row[1])
            else:
                result = {
                    "sentences_per_second": len(lines) / statistics.median(seconds),
                    "seconds": seconds,
                }
                if row != "plain":
                    result["cost_to_plain"] = statistics.median(seconds) / statistics.median(
                        measured["plain", name][0]
                    )
                result.update(_option_checks(row, found, measured["plain", name][1]))
            entry["systems"][name] = result
        for name, peer in PEER.items():
            ours, theirs = entry["systems"][name], entry["systems"][peer]
            ours["ratio_to_ct2"] = ours["sentences_per_second"] / theirs["sentences_per_second"]
            if row == "score":
                ours["largest_difference_to_ct2"] = max(
                    abs(a["log_prob"] - b["log_prob"])
                    for a, b in zip(measured[row, name][1], measured[row, peer][1], strict=True)
                    if a["log_prob"] is not None
                )
        entries.append(entry)
    fields = dict(sentences=len(lines), threads=args.threads)
    fields.update(parallel_batches=args.parallel_batches, repeats=args.repeats)
    if options:
        fields.update(beam_size=OPTIONS_BEAM, batch_size=OPTIONS_BATCH, options=entries)
    else:
        fields.update(size_bytes=sizes, cells=entries)
    report = harness.write_report("onnx_vs_ctranslate2", args, **fields)
    print(options_table(report) if options else table(report))
    return report


def _option_checks(option, found, plain):
    """What the outputs of `option` hold, checked against the plain translations."""
    if option == "plain":
        return {}
    if option == "score":
        return {"mean_log_prob": statistics.fmean(r["log_prob"] for r in found)}
    checks = {
        "first_equal_to_plain": sum(
            hypotheses[0]["text"] == text for hypotheses, text in zip(found, plain, strict=True)
        ),
        "hypotheses": sum(map(len, found)),
    }
    if option == "alignment":
        checks["aligned_tokens"] = sum(len(h[0]["alignment"]) for h in found)
    return checks


def options_table(report):
    """The markdown table of an `--options` report."""
    header = ["beam 4, batch 32", "ORT float32 (sent/s)", "cost", "CT2 float32", "cost"]
    header += ["ORT / CT2", "ORT int8", "cost", "CT2 int8", "cost", "ORT / CT2"]
    rows = []
    for entry in report["options"]:
        row = [entry["option"]]
        for ours, theirs in PEER.items():
            for name in (ours, theirs):
                measured = entry["systems"][name]
                cost = measured.get("cost_to_plain")
                row += [f"{measured['sentences_per_second']:.1f}", f"{cost or 1:.2f}x"]
            row.append(f"{entry['systems'][ours]['ratio_to_ct2']:.2f}x")
        rows.append(row)
    return harness.markdown(header, rows)


def table(report):
    """The markdown tables of a report: speed, lower-cased BLEU, sizes."""
    header = ["search, batch", "ORT float32 (sent/s)", "CT2 float32", "ORT / CT2", "ORT int8"]
    header += ["CT2 int8", "ORT / CT2", "identical to ORT float32 (ORT int8, CT2 float32, int8)"]
    rows = []
    for cell in report["cells"]:
        s = cell["systems"]
        rate = {name: f"{s[name]['sentences_per_second']:.1f}" for name in SYSTEMS}
        same = ", ".join(str(s[name]["identical_to_ort_float32"]) for name in SYSTEMS[1:])
        rows.append(
            [f"{cell['search']}, {cell['batch_size']}", rate["ort-float32"], rate["ct2-float32"]]
            + [f"{s['ort-float32']['ratio_to_ct2']:.2f}x", rate["ort-int8"], rate["ct2-int8"]]
            + [f"{s['ort-int8']['ratio_to_ct2']:.2f}x", f"{same} of {report['sentences']}"]
        )
    text = harness.markdown(header, rows)
    if "bleu_lowercase" in report["cells"][0]["systems"]["ort-float32"]:
        bleu = [
            [f"{cell['search']} (lower-cased BLEU)"]
            + [f"{cell['systems'][n]['bleu_lowercase']:.2f}" for n in SYSTEMS]
            for cell in report["cells"]
            if cell["batch_size"] == 32
        ]
        text += "\n\n" + harness.markdown(["search", *SYSTEMS], bleu)
    sizes = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in report["size_bytes"].items())
    return text + "\n\nSize on disk (MB): " + sizes


def combine(paths):
    """Per cell, the median over several runs' ORT / CT2 ratios, and each run's.

    Each ratio is measured side by side within its run; on a machine whose
    speed drifts between runs the median of several runs is the steadier figure.
    """
    reports = harness.read_reports(paths)
    n = len(reports)
    header = ["search, batch", f"float32 ORT / CT2, median of {n}", "each run"]
    header += [f"int8 ORT / CT2, median of {n}", "each run"]
    rows = []
    for i, cell in enumerate(reports[0]["cells"]):
        row = [f"{cell['search']}, {cell['batch_size']}"]
        for system in PEER:
            ratios = [r["cells"][i]["systems"][system]["ratio_to_ct2"] for r in reports]
            row += [f"{statistics.median(ratios):.2f}x", ", ".join(f"{x:.2f}" for x in ratios)]
        rows.append(row)
    return harness.markdown(header, rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["combine"]:
        if len(argv) < 2:
            raise SystemExit("usage: python -m benchmarks.onnx_vs_ctranslate2 combine RUN.json ...")
        print(combine(argv[1:]))
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    options = getattr(args, "options", None)
    if options and "score" in options and not args.ref:
        parser.error("--options score scores the references: give --ref")
    if args.out is None:
        name = "onnx_vs_ctranslate2-options.json" if options else "onnx_vs_ctranslate2.json"
        args.out = os.path.join(harness.RESULTS, name)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
