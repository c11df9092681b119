"""The `keras-transformer` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from keras_transformer_runtime.text import read_input_lines, warn


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
    from keras_transformer.train import KEEP_CHECKPOINTS, RunDirectoryError, TrainSettings, train

    try:
        settings = TrainSettings(
            src_train=args.src_train,
            tgt_train=args.tgt_train,
            src_valid=args.src_valid,
            tgt_valid=args.tgt_valid,
            preset=args.preset,
            epochs=args.epochs,
            max_steps=args.max_steps,
            max_minutes=args.max_minutes,
            tokens_per_batch=args.tokens_per_batch,
            precision=args.precision,
            label_smoothing=args.label_smoothing,
            warmup_steps=args.warmup_steps,
            learning_rate_scale=args.learning_rate_scale,
            cooldown=args.cooldown,
            accumulate_steps=args.accumulate_steps,
            vocab_size=args.vocab_size,
            subword_alpha=args.subword_alpha,
            subword_nbest=args.subword_nbest,
            rdrop_alpha=args.rdrop_alpha,
            num_layers=args.num_layers,
            hidden_dim=args.hidden_dim,
            intermediate_dim=args.intermediate_dim,
            num_heads=args.num_heads,
            dropout=args.dropout,
            attention_dropout=args.attention_dropout,
            normalize_first=args.normalize_first,
            seed=args.seed,
            select_by=args.select_by,
            patience=args.patience,
            average=args.average_last
            or (KEEP_CHECKPOINTS if args.average is None else args.average),
            final="last" if args.average_last else args.final,
            valid_beam=args.valid_beam,
            jit_compile=args.jit_compile,
            strategy=args.strategy,
        )
        train(settings, args.out)
    except (DataError, RunDirectoryError, ValueError, NotImplementedError) as error:
        raise SystemExit(f"error: {error}") from None
    return 0


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
    from keras_transformer.translation import translate_lines

    beam = _beam_size(args)
    length_penalty = _length_penalty(args)
    model, tokenizer = _load(args.run_dir)
    lines = read_input_lines(sys.stdin, warn)
    outputs = translate_lines(
        model,
        tokenizer,
        lines,
        beam_size=beam,
        length_penalty=length_penalty,
        batch_size=args.batch_size,
        progress=not sys.stdin.isatty() and len(lines) > args.batch_size,
        warn=warn,
    )
    sys.stdout.write("".join(line + "\n" for line in outputs))
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
    from keras_transformer.evaluation import score_translations
    from keras_transformer.io_utils import atomic_write_json, atomic_write_text
    from keras_transformer.translation import translate_lines

    beam = _beam_size(args)
    length_penalty = _length_penalty(args)
    from keras_transformer.data.pipeline import DataError, read_parallel

    try:
        sources, references = read_parallel(args.src, args.ref)
    except DataError as error:
        raise SystemExit(f"error: {error}") from None
    model, tokenizer = _load(args.run_dir)
    hypotheses = translate_lines(
        model,
        tokenizer,
        sources,
        beam_size=beam,
        length_penalty=length_penalty,
        batch_size=args.batch_size,
        progress=True,
        warn=warn,
    )
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
    atomic_write_json(output + ".json", scores)
    print(json.dumps(scores, indent=2))
    return 0


def _export(args):
    from keras_transformer.export.onnx import ExportError, export_onnx

    out = args.out or os.path.join(args.run_dir, "onnx")
    try:
        manifest = export_onnx(
            args.run_dir, out, opset=args.opset, precision=args.precision, overwrite=args.overwrite
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


def _add_search_flags(parser):
    parser.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    parser.add_argument("--greedy", action="store_true", help="greedy search instead of beam")
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=0.6,
        help="beam search's alpha: scores are divided by ((5 + length) / 6) ** alpha "
        "(Wu et al. 2016); default 0.6; higher favours longer translations; choose it on val",
    )
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

    train = sub.add_parser(
        "train",
        help="train on parallel text files; rerun the same command to resume",
        description="Train a Transformer on parallel text. Rerunning the same command on the "
        "same --out resumes after the last completed epoch.",
    )
    train.add_argument("--src-train", required=True, help="source side (plain or .gz)")
    train.add_argument("--tgt-train", required=True, help="target side, parallel to --src-train")
    train.add_argument("--src-valid", required=True)
    train.add_argument("--tgt-valid", required=True)
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("--preset", default="small", help="model preset (default: small)")
    stop = train.add_argument_group("when to stop (any that is reached first)")
    stop.add_argument("--epochs", type=int, help="epochs (default 10 when nothing else is set)")
    stop.add_argument("--max-steps", type=int, help="optimizer steps")
    stop.add_argument(
        "--max-minutes",
        type=float,
        help="training time; stops after the epoch where one more would exceed it",
    )
    train.add_argument(
        "--tokens-per-batch",
        type=int,
        help="padded tokens per batch on each side (default: 4096, or 2048 or 1024 where "
        "that leaves an epoch fewer than 400 updates)",
    )
    train.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "float32", "mixed_float16", "mixed_bfloat16"],
        help="auto (default): mixed_bfloat16 on a GPU or CPU that computes in bfloat16 "
        "(AVX512_BF16, AMX), float32 elsewhere",
    )
    train.add_argument("--label-smoothing", type=float, default=0.1)
    train.add_argument(
        "--warmup-steps",
        type=int,
        help="warm-up updates (default: 3 epochs of updates, at most the paper's 4000)",
    )
    train.add_argument(
        "--learning-rate-scale",
        type=float,
        help="multiplier on the paper's learning-rate curve (default: sqrt(warmup / 4000), "
        "which keeps the paper's peak learning rate for the model width)",
    )
    train.add_argument(
        "--cooldown",
        type=float,
        metavar="FRACTION",
        help="let the learning rate fall linearly to zero over this last fraction of the "
        "run's updates (needs --epochs or --max-steps; default: none, the paper's inverse "
        "square root to the end)",
    )
    train.add_argument(
        "--accumulate-steps",
        type=int,
        default=1,
        help="average the gradients of N batches per update: N times the batch on one device",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        default=8000,
        help="joint SentencePiece vocabulary size (default 8000)",
    )
    train.add_argument(
        "--subword-alpha",
        type=float,
        metavar="ALPHA",
        help="subword regularization: segment every training sentence anew each epoch, "
        "sampling from the SentencePiece model with this smoothing (e.g. 0.1; smaller "
        "samples more freely). Default: the one best segmentation",
    )
    train.add_argument(
        "--subword-nbest",
        type=int,
        default=64,
        metavar="L",
        help="with --subword-alpha, sample among the L best segmentations, or all with -1 "
        "(default 64)",
    )
    train.add_argument(
        "--rdrop-alpha",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="R-Drop: run every training sentence twice per step (two dropout masks) and add "
        "ALPHA times the symmetric KL divergence of the two predictions to the loss; each "
        "step computes twice the sentences (default 0: off)",
    )
    shape = train.add_argument_group("model shape (default: the preset's)")
    shape.add_argument("--num-layers", type=int, help="encoder layers, and as many decoder layers")
    shape.add_argument("--hidden-dim", type=int, help="d_model")
    shape.add_argument("--intermediate-dim", type=int, help="d_ff, the feed-forward inner width")
    shape.add_argument("--num-heads", type=int, help="attention heads; must divide --hidden-dim")
    train.add_argument("--dropout", type=float, help="override the preset's dropout")
    train.add_argument(
        "--attention-dropout",
        type=float,
        help="dropout on the attention weights alone (default: --dropout; 0 as in the paper "
        "lets training use the fused attention kernel)",
    )
    train.add_argument(
        "--normalize-first",
        action="store_true",
        default=None,
        help="pre-norm: LayerNorm before each sublayer instead of after the residual sum "
        "(default: the preset's, post-norm as in the paper)",
    )
    train.add_argument("--seed", type=int, default=0)
    choose = train.add_argument_group("choosing on the validation set")
    choose.add_argument(
        "--select-by",
        choices=["loss", "bleu"],
        help="the measure that ranks epochs: greedy BLEU, decoded after every epoch "
        "(default), or validation loss (the default with --strategy multi-worker)",
    )
    choose.add_argument(
        "--patience",
        type=int,
        help="stop after K epochs without a better validation measure",
    )
    choose.add_argument(
        "--average",
        type=int,
        help="average at most K epoch checkpoints into the final weights (default 10, "
        "the checkpoints train keeps)",
    )
    choose.add_argument(
        "--final",
        default="auto",
        choices=["auto", "last", "best"],
        help="final weights: auto (default) tries the last and the best epoch and the means "
        "of the last k and best k for k <= --average, and keeps the best on validation; "
        "last / best: the mean of the last / best --average epochs",
    )
    choose.add_argument(
        "--average-last",
        type=int,
        help="the mean of the last K epochs (the paper uses 5): --final last --average K",
    )
    train.add_argument(
        "--valid-beam",
        type=int,
        default=1,
        help="beam size for the final validation BLEU (default 1: greedy)",
    )
    train.add_argument("--jit-compile", action="store_true", help="compile the train step with XLA")
    train.add_argument(
        "--strategy",
        default="default",
        choices=["default", "mirrored", "multi-worker"],
        help="tf.distribute strategy: one device, all GPUs of this machine, or the "
        "cluster in TF_CONFIG",
    )
    train.set_defaults(func=_train)

    translate = sub.add_parser(
        "translate", help="translate lines from stdin to stdout, in order, one per line"
    )
    translate.add_argument("run_dir", help="run directory with model.keras and its tokenizer")
    _add_search_flags(translate)
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
    _add_search_flags(evaluate)
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
    export.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    export.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export in --out"
    )
    export.set_defaults(func=_export)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
