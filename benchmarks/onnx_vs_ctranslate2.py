"""ONNX Runtime against CTranslate2 on the same weights: float32 and int8, greedy and beam 4.

    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --src test.de.gz --ref test.en.gz
    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --src ... --ref ... --options nbest,score
    python -m benchmarks.onnx_vs_ctranslate2 combine A.json B.json C.json
    python -m benchmarks.onnx_vs_ctranslate2 RUN_DIR --marian-hf HF_DIR --src ... --cells beam4-32

The run is exported afresh to ONNX with its int8 graphs (RUN_DIR/onnx-int8) and
converted to CTranslate2 float32 and int8 folders (RUN_DIR/ct2-*) from the
same Keras weights (`benchmarks.ctranslate2_peer`). Each cell (search x batch
size) translates the same sentences with every system; repetitions are
interleaved across systems and the median is kept. Reported per cell and
system: sentences/s, the ratio to CTranslate2 at the same precision, the
outputs identical to ONNX Runtime float32, and BLEU. Writes JSON to
benchmarks/results/onnx_vs_ctranslate2.json (or --out).

`--threads T --parallel-batches P` gives both systems the same cores: P
batches at once (ONNX Runtime's `parallel_batches`, CTranslate2's
`inter_threads`), each on T threads. The default is one search on 2 threads.
With T > 1, ONNX Runtime float32 searches a batch of 32 as T parts at once,
one thread each (`OnnxTranslator`'s `split_batches`); `--whole-batches`
keeps each batch one search on T threads, as CTranslate2 does.

`--marian-hf HF_DIR` compares on a Marian model: RUN_DIR is its import
(`keras-transformer import marian HF_DIR`), and CTranslate2 converts HF_DIR
itself with its `TransformersConverter` (needs transformers and torch), as
a user of both would (docs/pretrained.md).

`--output-length N` makes every output exactly N tokens long in both systems
(minimum and maximum decoding length): the same work per sentence for a
model whose own outputs have no sensible lengths (random weights at a
pretrained model's shape, docs/pretrained.md).

`--options` measures the output options instead of the cells: beam 4 on
batches of 32, the plain search and then each option asked for, with the
same request to both systems (`OPTIONS`), side by side in each repetition.
Reported per option and system: sentences/s, the cost beside the same
system's plain search, ours / CTranslate2's, and checks on the outputs (the
first hypothesis against the plain translation; forced scores against the
other system's). Writes benchmarks/results/onnx_vs_ctranslate2-options.json
(or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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
    parser.add_argument("run_dir", help="a trained run (model.keras and spm.model)")
    parser.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    parser.add_argument("--ref", help="references, for BLEU")
    parser.add_argument("--lines", type=int, default=200, help="first N sentences (default 200)")
    parser.add_argument(
        "--threads", type=int, default=2, help="intra-op threads of each search, both systems"
    )
    parser.add_argument(
        "--parallel-batches",
        type=int,
        default=1,
        help="batches searched at once, both systems (ORT: parallel_batches; CT2: "
        "inter_threads); the cores used are --threads x --parallel-batches (default 1)",
    )
    parser.add_argument(
        "--whole-batches",
        action="store_true",
        help="ONNX Runtime searches each batch whole on --threads threads "
        "(split_batches=False), not one part per thread",
    )
    parser.add_argument(
        "--marian-hf",
        help="a Hugging Face MarianMT directory that RUN_DIR was imported from: CTranslate2 "
        "converts it with its TransformersConverter instead of our weights' spec",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    parser.add_argument(
        "--output-length",
        type=int,
        help="every output exactly this many tokens in both systems (minimum and maximum "
        "length): the same work whatever the model says, for a model not trained to "
        "sensible lengths",
    )
    parser.add_argument(
        "--cells",
        type=_cells,
        default=CELLS,
        help="comma-separated searches to run, of " + ", ".join(CELL_NAMES) + " (default: all)",
    )
    parser.add_argument(
        "--options",
        type=_options,
        default=argparse.SUPPRESS,  # absent from the default run's settings
        help="comma-separated output options to measure at beam 4, batch 32, beside the "
        "plain search, in place of the cells: " + ", ".join(OPTIONS) + " (score needs --ref)",
    )
    parser.add_argument("--out", help="the JSON report (default: benchmarks/results/...)")
    return parser


def _options(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OPTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown option {', '.join(unknown) or text!r}; choose from {', '.join(OPTIONS)}"
        )
    return tuple(dict.fromkeys(names))


def _cells(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CELL_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown cell {', '.join(unknown) or text!r}; choose from {', '.join(CELL_NAMES)}"
        )
    return tuple(CELL_NAMES[name] for name in names)


def _systems(
    run_dir, tokenizer, model, threads, parallel_batches, split_batches=None, marian_hf=None
):
    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.ctranslate2_peer import CTranslate2Translator, ctranslate2_model
    from keras_transformer.export.forced_graph import FORCED_GRAPHS
    from keras_transformer.export.onnx import export_onnx

    # Exported afresh every time: a folder left by older code would otherwise
    # be measured in place of the graphs this code writes.
    onnx_dir = os.path.join(run_dir, "onnx-int8")
    export_onnx(run_dir, onnx_dir, precision="int8", overwrite=True)
    systems, sizes = {}, {}
    for precision in ("float32", "int8"):
        name = f"ort-{precision}"
        systems[name] = OnnxTranslator(
            onnx_dir,
            providers=["CPUExecutionProvider"],
            num_threads=threads,
            precision=precision,
            split_batches=split_batches,
        )
        manifest = systems[name].manifest
        files = [
            graph[precision]
            for key, graph in manifest["graphs"].items()
            if key not in FORCED_GRAPHS  # the teacher-forced graphs do not translate
        ] + [manifest["weights"][precision]]  # their weights, stored once
        sizes[name] = sum(os.path.getsize(os.path.join(onnx_dir, f)) for f in files)
        folder = os.path.join(run_dir, f"ct2-{precision}")
        quantization = None if precision == "float32" else "int8"
        if marian_hf is not None:
            import ctranslate2

            folder = os.path.join(run_dir, f"ct2-marian-{precision}")
            converter = ctranslate2.converters.TransformersConverter(marian_hf)
            converter.convert(folder, quantization=quantization, force=True)
        elif not os.path.isfile(os.path.join(folder, "model.bin")):
            ctranslate2_model(model, tokenizer, folder, quantization)
        name = f"ct2-{precision}"
        # Each in a process of its own: see CTranslate2Translator.
        systems[name] = CTranslate2Translator(
            folder, tokenizer, precision, threads, parallel_batches, isolated=True
        )
        sizes[name] = os.path.getsize(os.path.join(folder, "model.bin"))
    return systems, sizes


def _load(args):
    """The sentences, references, tokenizer, systems and sizes that both modes time."""
    from keras_transformer.data.pipeline import read_lines
    from keras_transformer.export.onnx import float32_copy
    from keras_transformer.translation import load_run

    lines = read_lines(args.src)[: args.lines]
    references = read_lines(args.ref)[: args.lines] if args.ref else None
    model, tokenizer = load_run(args.run_dir)
    systems, sizes = _systems(
        args.run_dir,
        tokenizer,
        float32_copy(model),
        args.threads,
        args.parallel_batches,
        False if args.whole_batches else None,
        args.marian_hf,
    )
    return lines, references, tokenizer, systems, sizes


def run(args):
    from benchmarks.machine import write_report
    from keras_transformer.evaluation import score_translations

    lines, references, tokenizer, systems, sizes = _load(args)
    results = []
    for label, beam, batch in args.cells:
        times = {name: [] for name in SYSTEMS}
        outputs = {}
        for _ in range(args.repeats):
            for name in SYSTEMS:
                start = time.perf_counter()
                outputs[name] = _translate(name, systems[name], lines, beam, batch, args)
                times[name].append(time.perf_counter() - start)
        cell = {"search": label, "beam_size": beam, "batch_size": batch, "systems": {}}
        for name in SYSTEMS:
            # Target tokens as CTranslate2's benchmark counts them: the pieces
            # of each output, without BOS and EOS.
            tokens = sum(len(tokenizer.encode_target(text)) for text in outputs[name])
            entry = {
                "sentences_per_second": len(lines) / statistics.median(times[name]),
                "target_tokens_per_second": tokens / statistics.median(times[name]),
                "target_tokens": tokens,
                "seconds": times[name],
                "identical_to_ort_float32": sum(
                    a == b for a, b in zip(outputs[name], outputs["ort-float32"], strict=True)
                ),
            }
            if references is not None:
                scores = score_translations(outputs[name], references)
                entry.update({k: scores[k] for k in ("bleu", "bleu_lowercase", "chrf")})
            if name.startswith("ort"):  # the searches a full batch runs as
                entry["split_parts"] = systems[name].decoder.split_parts(batch, beam)
            cell["systems"][name] = entry
        for name, peer in PEER.items():
            ours, theirs = cell["systems"][name], cell["systems"][peer]
            ours["ratio_to_ct2"] = ours["sentences_per_second"] / theirs["sentences_per_second"]
        results.append(cell)
        print(_row(f"{cell['search']}, batch {cell['batch_size']}:", cell["systems"]), flush=True)
    for name in SYSTEMS:
        if name.startswith("ct2"):
            systems[name].close()
    report = write_report(
        "onnx_vs_ctranslate2",
        args,
        sentences=len(lines),
        threads=args.threads,
        parallel_batches=args.parallel_batches,
        repeats=args.repeats,
        size_bytes=sizes,
        cells=results,
    )
    print(table(report))
    return report


def _translate(name, system, lines, beam, batch, args):
    """`system.translate` of `lines` (system `name` of `SYSTEMS`), with every output
    `args.output_length` tokens long where that is given."""
    if args.output_length is None:
        return system.translate(
            lines, beam_size=beam, batch_size=batch, parallel_batches=args.parallel_batches
        )
    length = args.output_length
    if name.startswith("ort"):  # ours: EOS suppressed, `length` tokens at most
        from keras_transformer_runtime.options import SearchOptions
        from keras_transformer_runtime.specials import EOS_ID

        options = SearchOptions(beam, max_length=length, suppress_sequences=((EOS_ID,),))
        return system.translate(
            lines, batch_size=batch, parallel_batches=args.parallel_batches, options=options
        )
    return system.translate(
        lines,
        beam_size=beam,
        batch_size=batch,
        parallel_batches=args.parallel_batches,
        min_decoding_length=length,
        max_decoding_length=length,
    )


def run_options(args):
    """The cost of each of `args.options` beside the plain search, for every system."""
    from keras_transformer_runtime.options import SearchOptions

    from benchmarks.machine import write_report

    lines, references, tokenizer, systems, _ = _load(args)
    batch, parallel = OPTIONS_BATCH, args.parallel_batches

    def request(name, option):
        system = systems[name]
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

    names = ("plain", *args.options)
    times = {option: {name: [] for name in SYSTEMS} for option in names}
    outputs = {option: {} for option in names}
    for _ in range(args.repeats):
        for option in names:
            for name in SYSTEMS:
                start = time.perf_counter()
                outputs[option][name] = request(name, option)
                times[option][name].append(time.perf_counter() - start)
    for name in SYSTEMS:
        if name.startswith("ct2"):
            systems[name].close()
    results = []
    for option in names:
        entry = {"option": option, "systems": {}}
        for name in SYSTEMS:
            found = outputs[option][name]
            seconds = times[option][name]
            measured = {
                "sentences_per_second": len(lines) / statistics.median(seconds),
                "seconds": seconds,
            }
            if option != "plain":
                measured["cost_to_plain"] = statistics.median(seconds) / statistics.median(
                    times["plain"][name]
                )
            measured.update(_option_checks(option, found, outputs["plain"][name]))
            entry["systems"][name] = measured
        for name, peer in PEER.items():
            ours, theirs = entry["systems"][name], entry["systems"][peer]
            ours["ratio_to_ct2"] = ours["sentences_per_second"] / theirs["sentences_per_second"]
            if option == "score":
                ours["largest_difference_to_ct2"] = max(
                    abs(a["log_prob"] - b["log_prob"])
                    for a, b in zip(outputs[option][name], outputs[option][peer], strict=True)
                    if a["log_prob"] is not None
                )
        results.append(entry)
        print(_row(f"{entry['option']}:", entry["systems"]), flush=True)
    report = write_report(
        "onnx_vs_ctranslate2",
        args,
        sentences=len(lines),
        threads=args.threads,
        parallel_batches=args.parallel_batches,
        repeats=args.repeats,
        beam_size=OPTIONS_BEAM,
        batch_size=batch,
        options=results,
    )
    print(options_table(report))
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
    lines = [
        "| beam 4, batch 32 | ORT float32 (sent/s) | cost | CT2 float32 | cost | ORT / CT2 "
        "| ORT int8 | cost | CT2 int8 | cost | ORT / CT2 |",
        "| --- |" + " --- |" * 10,
    ]
    for entry in report["options"]:
        row = [entry["option"]]
        for ours, theirs in PEER.items():
            for name in (ours, theirs):
                measured = entry["systems"][name]
                cost = measured.get("cost_to_plain")
                row += [
                    f"{measured['sentences_per_second']:.1f}",
                    "1" if cost is None else f"{cost:.2f}x",
                ]
            row.append(f"{entry['systems'][ours]['ratio_to_ct2']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _row(label, systems):
    """A progress line: `label` and each system's sentences/s."""
    rates = [f"{name} {entry['sentences_per_second']:.1f}/s" for name, entry in systems.items()]
    return " ".join([label, *rates])


def table(report):
    """The markdown table of a report."""
    lines = [
        "| search, batch | ORT float32 (sent/s) | CT2 float32 | ORT / CT2 | ORT int8 | CT2 int8 "
        "| ORT / CT2 | identical to ORT float32 (ORT int8, CT2 float32, CT2 int8) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    total = report["sentences"]
    for cell in report["cells"]:
        s = cell["systems"]
        lines.append(
            f"| {cell['search']}, {cell['batch_size']} "
            f"| {s['ort-float32']['sentences_per_second']:.1f} "
            f"| {s['ct2-float32']['sentences_per_second']:.1f} "
            f"| {s['ort-float32']['ratio_to_ct2']:.2f}x "
            f"| {s['ort-int8']['sentences_per_second']:.1f} "
            f"| {s['ct2-int8']['sentences_per_second']:.1f} "
            f"| {s['ort-int8']['ratio_to_ct2']:.2f}x "
            f"| {s['ort-int8']['identical_to_ort_float32']}, "
            f"{s['ct2-float32']['identical_to_ort_float32']}, "
            f"{s['ct2-int8']['identical_to_ort_float32']} of {total} |"
        )
    if "bleu_lowercase" in report["cells"][0]["systems"]["ort-float32"]:
        lines += ["", "| search | " + " | ".join(SYSTEMS) + " |", "| --- |" + " --- |" * 4]
        for cell in report["cells"]:
            if cell["batch_size"] != 32:
                continue
            bleu = [f"{cell['systems'][n]['bleu_lowercase']:.2f}" for n in SYSTEMS]
            lines.append(f"| {cell['search']} (lower-cased BLEU) | " + " | ".join(bleu) + " |")
    sizes = report["size_bytes"]
    lines += ["", "Size on disk (MB): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sizes.items())]
    return "\n".join(lines)


def combine(paths):
    """Per cell, the median over several runs' ORT / CT2 ratios, and each run's.

    Each ratio is measured side by side within its run; on a machine whose
    speed drifts between runs the median of several runs is the steadier figure.
    """
    reports = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    lines = [
        f"| search, batch | float32 ORT / CT2, median of {len(reports)} | each run "
        f"| int8 ORT / CT2, median of {len(reports)} | each run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, cell in enumerate(reports[0]["cells"]):
        row = [f"{cell['search']}, {cell['batch_size']}"]
        for system in ("ort-float32", "ort-int8"):
            ratios = [r["cells"][i]["systems"][system]["ratio_to_ct2"] for r in reports]
            row += [
                f"{statistics.median(ratios):.2f}x",
                ", ".join(f"{x:.2f}" for x in ratios),
            ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


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
    if options and "score" in args.options and not args.ref:
        parser.error("--options score scores the references: give --ref")
    if args.out is None:
        name = "onnx_vs_ctranslate2-options.json" if options else "onnx_vs_ctranslate2.json"
        args.out = os.path.join("benchmarks", "results", name)
    args.argv = argv
    (run_options if options else run)(args)


if __name__ == "__main__":
    main()
