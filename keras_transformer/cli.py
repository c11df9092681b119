"""The `keras-transformer` command line."""

from __future__ import annotations

import argparse
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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
