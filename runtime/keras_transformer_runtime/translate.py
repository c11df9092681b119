"""Translate stdin to stdout with an ONNX export: `keras-transformer-translate ONNX_DIR [--beam N]`.

Also `python -m keras_transformer_runtime.translate`.

One output line per input line, in order. Needs numpy, onnxruntime and
sentencepiece only (no TensorFlow, no Keras).
"""

from __future__ import annotations

import argparse
import sys

from keras_transformer_runtime.export_format import ExportFileError
from keras_transformer_runtime.onnx_sessions import available_cores
from keras_transformer_runtime.onnx_translator import OnnxTranslator
from keras_transformer_runtime.search_flags import (
    add_search_flags,
    command_output,
    options_from_args,
)
from keras_transformer_runtime.text import read_input, warn


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-transformer-translate",
        description="Translate lines from stdin to stdout with an ONNX export of keras-transformer.",
    )
    parser.add_argument("onnx_dir", help="folder written by `keras-transformer export`")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    parser.add_argument(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads of each search (default: ONNX Runtime's "
        "choice; with --parallel-batches, the cores shared out)",
    )
    parser.add_argument(
        "--parallel-batches",
        type=int,
        default=1,
        help="batches translated at once, each on its own thread (default 1); on a "
        "CPU, the number of cores, one thread each, is usually the fastest",
    )
    parser.add_argument(
        "--whole-batches",
        action="store_true",
        help="search each batch as one search on all --threads; by default, on a CPU, a "
        "float32 or float16 batch large enough runs as one search per thread at once",
    )
    parser.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "float16", "int8"],
        help="graphs to run: float32 (default), float16 (GPU) or int8 (CPU), where exported",
    )
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is usable")
    parser.add_argument(
        "--no-shortlist",
        action="store_true",
        help="search the whole vocabulary where the export has a shortlist (by default its "
        "search graphs score each batch's listed pieces only)",
    )
    add_search_flags(parser)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("beam", "batch_size", "max_length", "threads", "parallel_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a positive integer.")
    if not args.length_penalty >= 0:  # also refuses nan
        raise SystemExit(
            f"error: --length-penalty must be a non-negative number. Received: {args.length_penalty}"
        )
    threads = args.threads
    if threads is None and args.parallel_batches > 1:
        threads = max(1, available_cores() // args.parallel_batches)
    try:
        translator = OnnxTranslator(
            args.onnx_dir,
            providers=["CPUExecutionProvider"] if args.cpu else None,
            num_threads=threads,
            precision=args.precision,
            split_batches=False if args.whole_batches else None,
            shortlist=False if args.no_shortlist else None,
        )
        lines = read_input(sys.stdin, warn, whole=args.input_format != "text")
        options = options_from_args(args, translator.tokenizer)
        progress = not sys.stdin.isatty() and len(lines) > args.batch_size
        text = command_output(
            args, lines, options, translator, progress, warn, args.parallel_batches
        )
    except (ExportFileError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"provider: {translator.provider}", file=sys.stderr)
    if translator.decoder.shortlist is not None:
        print("vocabulary: the export's shortlist (--no-shortlist: all of it)", file=sys.stderr)
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
