"""The `keras-transformer` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from keras_transformer_runtime.search_flags import (
    add_search_flags,
    command_output,
    options_from_args,
    read_constraints,
    read_lines_file,
)
from keras_transformer_runtime.text import read_input, warn

from keras_transformer.settings_parser import add_settings_arguments, settings_values


def _demo(args):
    from keras_transformer.demo import run_demo

    run_demo(
        out_dir=args.out,
        epochs=args.epochs,
        seed=args.seed,
        num_train=args.num_train,
        num_test=args.num_test,
    )
    return 0


def _train(args):
    from keras_transformer.data.pipeline import DataError
    from keras_transformer.train import RunDirectoryError, TrainSettings, train

    try:
        settings = _settings_from_arguments(args, TrainSettings)
        result = train(settings, args.out)
    except (DataError, RunDirectoryError, ValueError, NotImplementedError) as error:
        raise SystemExit(f"error: {error}") from None
    if result.get("stopped_by"):
        # Stopped by a signal, everything saved: exit now. Finalizing the abandoned
        # data stream's threads took 15-40 s more, past a scheduler's grace period.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _prepare(args):
    from keras_transformer.data.pipeline import DataError
    from keras_transformer.data.prepare import prepare_command

    try:
        return prepare_command(args)
    except (DataError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


def _data(args):
    from keras_transformer.data.fetch import FetchError, data_command

    try:
        return data_command(args)
    except FetchError as error:
        raise SystemExit(f"error: {error}") from None


def _add_train_arguments(parser):
    """`train`'s options: `--out`, one per `TrainSettings` field, and `--average-last`."""
    from keras_transformer.train.settings import GROUPS, TrainSettings

    parser.add_argument("--out", required=True, help="run directory")
    sections = add_settings_arguments(parser, TrainSettings, GROUPS)
    sections["selection"].add_argument(
        "--average-last",
        type=int,
        help="the mean of the last K epochs (the paper uses 5): --final last --average K",
    )


def _settings_from_arguments(args, settings_class):
    """The dataclass `settings_class` from the parsed options of its fields.

    `--average-last K`, the one option that is not a field, stands for
    `--final last --average K`.
    """
    values = settings_values(args, settings_class)
    if args.average_last:
        values.update(final="last", average=args.average_last)
    return settings_class(**values)


def _length_penalty(args):
    if not args.length_penalty >= 0:  # also refuses nan
        raise SystemExit(
            f"error: --length-penalty must be a non-negative number. Received: {args.length_penalty}"
        )
    return args.length_penalty


def _beam_size(args):
    if args.greedy:
        return 1
    if args.beam < 1:
        raise SystemExit(f"error: --beam must be a positive integer. Received: {args.beam}")
    return args.beam


def _load(run_dir):
    from keras_transformer.translation import load_run

    try:
        return load_run(run_dir)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


def _translate(args):
    from keras_transformer.decoding import translator

    beam = _beam_size(args)
    _length_penalty(args)  # refused before the model loads
    model, tokenizer = _load(args.run_dir)
    lines = read_input(sys.stdin, warn, whole=args.input_format != "text")
    options = options_from_args(args, tokenizer, beam_size=beam)
    progress = not sys.stdin.isatty() and len(lines) > args.batch_size
    try:
        sys.stdout.write(
            command_output(args, lines, options, translator(model, tokenizer), progress, warn)
        )
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    sys.stdout.flush()
    if args.plot_attention:
        _plot(args, model, tokenizer, lines, beam)
    return 0


def _plot(args, model, tokenizer, lines, beam):
    from keras_transformer.plotting import attention_figure_data, plot_attention

    if not 1 <= args.plot_line <= len(lines):
        raise SystemExit(
            f"error: --plot-line {args.plot_line} is out of range: {len(lines)} input line(s)."
        )
    text = lines[args.plot_line - 1]
    try:
        weights, src, tgt, translation = attention_figure_data(model, tokenizer, text, beam)
    except ValueError as error:
        raise SystemExit(f"error: line {args.plot_line}: {error}") from None
    title = f"{text}\n-> {translation}\n(last decoder layer, mean over heads)"
    plot_attention(weights, src, tgt, args.plot_attention, title=title)
    print(
        f"Wrote the cross-attention of line {args.plot_line} to {args.plot_attention}",
        file=sys.stderr,
    )


def _evaluate(args):
    from keras_transformer.data.pipeline import DataError, read_parallel
    from keras_transformer.decoding import translator
    from keras_transformer.evaluation import score_translations
    from keras_transformer.io_utils import atomic_write_json, atomic_write_text

    beam = _beam_size(args)
    length_penalty = _length_penalty(args)

    try:
        sources, references = read_parallel(args.src, args.ref)
    except DataError as error:
        raise SystemExit(f"error: {error}") from None
    model, tokenizer = _load(args.run_dir)
    options = options_from_args(args, tokenizer, beam_size=beam)
    prefixes = read_lines_file(args.prefix, len(sources), "--prefix") if args.prefix else None
    constraints = read_constraints(args.constraints, len(sources)) if args.constraints else None
    try:
        found = translator(model, tokenizer).translate_hypotheses(
            sources, options, prefixes, args.batch_size, True, warn, constraints
        )
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    hypotheses = [h[0]["text"] for h in found]
    name = os.path.basename(args.src).removesuffix(".gz")
    output = args.output or os.path.join(args.run_dir, f"{name}.hyp")
    atomic_write_text(output, "".join(h + "\n" for h in hypotheses))
    scores = score_translations(hypotheses, references)
    scores.update(
        {
            "beam_size": beam,
            "length_penalty": length_penalty if beam > 1 else None,
            "src": args.src,
            "ref": args.ref,
            "hypotheses": output,
        }
    )
    if not options.is_plain() or args.prefix:
        scores["search_options"] = {
            **dataclasses.asdict(options),
            "prefix": args.prefix,
        }
    atomic_write_json(output + ".json", scores)
    print(json.dumps(scores, indent=2))
    return 0


def _export(args):
    from keras_transformer.export.onnx import ExportError, export_onnx

    if args.format == "marian-hf":
        return _export_marian(args)
    out = args.out or os.path.join(args.run_dir, "onnx")
    try:
        manifest = export_onnx(
            args.run_dir,
            out,
            opset=args.opset,
            precision=args.precision,
            overwrite=args.overwrite,
            source_language=args.source_language,
            shortlist=_shortlist(args),
        )
    except (ExportError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    files = sorted(
        f
        for graph in manifest["graphs"].values()
        for k, f in graph.items()
        if k in ("float32", "float16", "int8")
    ) + sorted(manifest.get("weights", {}).values())
    print(f"Wrote {', '.join(files)} and {manifest.get('tokenizer', 'no tokenizer')} to {out}")
    return 0


def _shortlist(args):
    """The shortlist of `export --shortlist-data SRC TGT`, or None."""
    if not args.shortlist_data:
        return None
    from keras_transformer.export.shortlist_data import shortlist_from_files
    from keras_transformer.model import transformer_parts
    from keras_transformer.translation import load_run

    if args.shortlist_per_piece < 1 or args.shortlist_frequent < 0:
        raise SystemExit(
            "error: --shortlist-per-piece must be at least 1 and --shortlist-frequent at least 0"
        )
    model, tokenizer = load_run(args.run_dir)
    source, target = args.shortlist_data
    return shortlist_from_files(
        tokenizer,
        transformer_parts(model).config.vocabulary_size,
        source,
        target,
        args.shortlist_per_piece,
        args.shortlist_frequent,
    )


def _export_marian(args):
    from keras_transformer.pretrained.marian import MarianImportError
    from keras_transformer.pretrained.marian_export import export_marian_hf

    if not args.out:
        raise SystemExit("error: --format marian-hf needs --out DIR")
    try:
        files = export_marian_hf(args.run_dir, args.out, overwrite=args.overwrite)
    except (MarianImportError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Wrote {', '.join(files)} to {args.out}")
    return 0


def _import(args):
    from keras_transformer.pretrained.marian import MarianImportError, import_marian

    try:
        out = import_marian(args.source, args.out, overwrite=args.overwrite)
    except (MarianImportError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Imported {args.source} into {out} (model.keras and its Marian tokenizer)")
    return 0


def _add_batch_flags(parser):
    """--greedy (the same as --beam 1) and --batch-size; the decoding options are
    `add_search_flags`'s, made from `SearchOptions`."""
    parser.add_argument("--greedy", action="store_true", help="greedy search (--beam 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-transformer",
        description="Train, evaluate, translate with and export the paper's Transformer.",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep TensorFlow's own log lines (device probes, INFO messages)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the tiny preset on the built-in toy corpus")
    demo.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--num-train", type=int, default=20000, help="training sentence pairs")
    demo.add_argument("--num-test", type=int, default=500, help="held-out test pairs")
    demo.set_defaults(func=_demo)

    from keras_transformer.data.prepare import add_prepare_arguments

    prepare = sub.add_parser(
        "prepare",
        help="tokenize parallel text of any size into on-disk shards for train --data",
        description="Train the joint SentencePiece model on a sample, encode every pair in "
        "parallel and write the ids in shards (docs/data.md). Rerun the same command to "
        "resume a killed run; on a finished directory it does nothing.",
    )
    add_prepare_arguments(prepare)
    prepare.set_defaults(func=_prepare)

    from keras_transformer.data.fetch import add_data_arguments

    data = sub.add_parser(
        "data",
        help="download a published corpus (Multi30k) and check its SHA-256",
        description="Download a published corpus into --out, checking every file's SHA-256. "
        "`data list` names each corpus, its license, citation and files.",
    )
    add_data_arguments(data)
    data.set_defaults(func=_data)

    train = sub.add_parser(
        "train",
        help="train on parallel text files; rerun the same command to resume",
        description="Train a Transformer on parallel text. Rerunning the same command on the "
        "same --out resumes after the last completed epoch.",
    )
    _add_train_arguments(train)
    train.set_defaults(func=_train)

    translate = sub.add_parser(
        "translate", help="translate lines from stdin to stdout, in order, one per line"
    )
    translate.add_argument("run_dir", help="run directory with model.keras and its tokenizer")
    _add_batch_flags(translate)
    add_search_flags(translate)
    translate.add_argument(
        "--plot-attention",
        metavar="PNG",
        help="also draw one sentence's cross-attention weights (source x output pieces)",
    )
    translate.add_argument(
        "--plot-line",
        type=int,
        default=1,
        help="which input line --plot-attention draws (default 1)",
    )
    translate.set_defaults(func=_translate)

    evaluate = sub.add_parser("evaluate", help="translate a file and score it with sacreBLEU")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    evaluate.add_argument("--ref", required=True, help="reference translations, parallel to --src")
    evaluate.add_argument("--output", help="hypotheses file (default: RUN_DIR/<src name>.hyp)")
    _add_batch_flags(evaluate)
    add_search_flags(evaluate, outputs=False)
    evaluate.set_defaults(func=_evaluate)

    export = sub.add_parser(
        "export",
        help="convert a run to ONNX graphs for ONNX Runtime (keras-transformer-translate)",
    )
    export.add_argument("run_dir", help="run directory with model.keras and its tokenizer")
    export.add_argument("--out", help="export folder (default: RUN_DIR/onnx)")
    export.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "float16", "int8"],
        help="float16 also writes float16 graphs (for GPUs); int8 also writes graphs with "
        "int8 weight matrices (dynamic quantization, for CPUs)",
    )
    export.add_argument(
        "--format",
        default="onnx",
        choices=["onnx", "marian-hf"],
        help="onnx (graphs for keras-transformer-translate and -serve), or marian-hf: a "
        "Hugging Face MarianMT directory, for models imported with `import marian`",
    )
    export.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    export.add_argument(
        "--source-language",
        metavar="CODE",
        help="the source language's code (de, en, ...), kept in the manifest: the "
        "translate commands split documents into sentences by its rules",
    )
    export.add_argument(
        "--shortlist-data",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="parallel training text (plain or .gz) to count a vocabulary shortlist from: "
        "the export's search graphs then score only each batch's listed pieces "
        "(docs/onnx.md, 'Shortlists')",
    )
    export.add_argument(
        "--shortlist-per-piece",
        type=int,
        default=10,
        metavar="N",
        help="target pieces listed per source piece (default 10: chosen on Multi30k's val, "
        "benchmarks/README.md)",
    )
    export.add_argument(
        "--shortlist-frequent",
        type=int,
        default=100,
        metavar="N",
        help="most frequent target pieces on every list (default 100)",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export in --out"
    )
    export.set_defaults(func=_export)

    distilled = sub.add_parser(
        "distill",
        help="translate training sources with a teacher: a student's training data",
    )
    distilled.add_argument("teacher", help="an export folder, or a run directory (exported once)")
    distilled.add_argument("--src", required=True, help="the training sources (plain or .gz)")
    distilled.add_argument(
        "--tgt", help="their references: each chunk's original pairs follow its distilled ones"
    )
    distilled.add_argument(
        "--out", required=True, help="the folder of train.src and train.tgt (resumed if killed)"
    )
    distilled.add_argument("--beam", type=int, default=4, help="the teacher's beam (default 4)")
    distilled.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    distilled.add_argument(
        "--chunk-lines", type=int, default=20000, help="lines written at a time (default 20000)"
    )
    distilled.add_argument(
        "--parallel", type=int, help="searches at once, one thread each (default: the cores)"
    )
    distilled.set_defaults(func=_distill)

    imported = sub.add_parser(
        "import", help="turn a pretrained checkpoint of another toolkit into a run directory"
    )
    imported.add_argument("kind", choices=["marian"], help="the checkpoint's family")
    imported.add_argument(
        "source",
        help="a Hugging Face MarianMT directory (config.json, model.safetensors, source.spm, "
        "target.spm, vocab.json), or a hub name such as Helsinki-NLP/opus-mt-de-en",
    )
    imported.add_argument("--out", required=True, help="the run directory to write")
    imported.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    imported.set_defaults(func=_import)
    return parser


def _distill(args):
    from keras_transformer.distill import DistillError, distill

    for name in ("beam", "batch_size", "chunk_lines", "parallel"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a positive integer.")

    def progress(done, total):
        print(f"distilled {done} of {total} lines", file=sys.stderr, flush=True)

    try:
        done = distill(
            args.teacher,
            args.src,
            args.out,
            tgt=args.tgt,
            beam_size=args.beam,
            batch_size=args.batch_size,
            chunk_lines=args.chunk_lines,
            parallel=args.parallel,
            progress=progress,
        )
    except DistillError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Wrote the teacher's translations of {done} lines to {args.out}/train.src and train.tgt")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
