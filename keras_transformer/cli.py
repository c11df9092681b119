"""The `keras-transformer` command line."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys


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


def _read_lines(path):
    if not os.path.isfile(path):
        raise SystemExit(f"error: file not found: {path}")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


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
    model, tokenizer = _load(args.run_dir)
    lines = [line.rstrip("\n") for line in sys.stdin]
    outputs = translate_lines(
        model,
        tokenizer,
        lines,
        beam_size=beam,
        batch_size=args.batch_size,
        progress=not sys.stdin.isatty() and len(lines) > args.batch_size,
    )
    sys.stdout.write("".join(line + "\n" for line in outputs))
    return 0


def _evaluate(args):
    from keras_transformer.evaluation import score_translations
    from keras_transformer.io_utils import atomic_write_json, atomic_write_text
    from keras_transformer.translation import translate_lines

    beam = _beam_size(args)
    sources, references = _read_lines(args.src), _read_lines(args.ref)
    if len(sources) != len(references):
        raise SystemExit(
            f"error: {args.src} has {len(sources)} lines but {args.ref} has "
            f"{len(references)}; they must be parallel, one sentence per line."
        )
    model, tokenizer = _load(args.run_dir)
    hypotheses = translate_lines(
        model, tokenizer, sources, beam_size=beam, batch_size=args.batch_size, progress=True
    )
    name = os.path.basename(args.src).removesuffix(".gz")
    output = args.output or os.path.join(args.run_dir, f"{name}.hyp")
    atomic_write_text(output, "".join(h + "\n" for h in hypotheses))
    scores = score_translations(hypotheses, references)
    scores.update({"beam_size": beam, "src": args.src, "ref": args.ref, "hypotheses": output})
    atomic_write_json(output + ".json", scores)
    print(json.dumps(scores, indent=2))
    return 0


def _add_search_flags(parser):
    parser.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    parser.add_argument("--greedy", action="store_true", help="greedy search instead of beam")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-transformer",
        description="Train, evaluate, translate with and export the paper's Transformer.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the tiny preset on the built-in toy corpus")
    demo.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--num-train", type=int, default=20000, help="training sentence pairs")
    demo.add_argument("--num-test", type=int, default=500, help="held-out test pairs")
    demo.set_defaults(func=_demo)

    translate = sub.add_parser(
        "translate", help="translate lines from stdin to stdout, in order, one per line"
    )
    translate.add_argument("run_dir", help="run directory with model.keras and its tokenizer")
    _add_search_flags(translate)
    translate.set_defaults(func=_translate)

    evaluate = sub.add_parser("evaluate", help="translate a file and score it with sacreBLEU")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    evaluate.add_argument("--ref", required=True, help="reference translations, parallel to --src")
    evaluate.add_argument("--output", help="hypotheses file (default: RUN_DIR/<src name>.hyp)")
    _add_search_flags(evaluate)
    evaluate.set_defaults(func=_evaluate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
