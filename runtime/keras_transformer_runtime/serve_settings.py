"""The flags of `keras-transformer-serve`, each with its default and its check."""

from __future__ import annotations

import argparse
import math


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-transformer-serve",
        description="Serve translations of an ONNX export of keras-transformer over HTTP, "
        "batching the sentences of concurrent requests.",
    )
    add = parser.add_argument
    add("onnx_dir", help="folder written by `keras-transformer export`")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8080, help="port to listen on (default 8080)")
    add(
        "--workers",
        type=int,
        help="batches searched at once, each on its own thread with a translator of its own "
        "(default 1: a batch on a CPU already runs as one part per thread)",
    )
    add(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads of each worker (default: the cores shared out)",
    )
    add(
        "--precision",
        default="float32",
        choices=["float32", "float16", "int8"],
        help="graphs to run, where exported (default float32)",
    )
    add("--cpu", action="store_true", help="run on CPU even when CUDA is usable")
    add(
        "--no-shortlist",
        action="store_true",
        help="search the whole vocabulary where the export has a shortlist",
    )
    add(
        "--max-batch-sentences",
        type=int,
        default=32,
        help="sentences per batch at most (default 32); 1 turns batching across requests off",
    )
    add(
        "--max-batch-tokens",
        type=int,
        default=4096,
        help="source tokens per batch at most, padded to its longest sentence (default 4096)",
    )
    add(
        "--max-wait-ms",
        type=float,
        default=25.0,
        help="how long the oldest waiting sentence waits at most for a batch to fill (default 25)",
    )
    add(
        "--quiet-ms",
        type=float,
        default=2.0,
        help="a batch that is not full leaves once no sentence has arrived for this long "
        "(default 2)",
    )
    add(
        "--max-queue-sentences",
        type=int,
        default=20000,
        help="sentences waiting for a batch at most; beyond, requests get 503 (default 20000)",
    )
    add(
        "--max-texts",
        type=int,
        default=10000,
        help="texts per request at most; beyond, 413 (default 10000)",
    )
    add(
        "--max-chars",
        type=int,
        default=1_000_000,
        help="characters per request at most, all texts together; beyond, 413 (default 1000000)",
    )
    add(
        "--max-beam-size",
        type=int,
        default=16,
        help="largest beam_size a request may ask for (default 16)",
    )
    add(
        "--max-decoding-length",
        type=int,
        default=512,
        help="largest max_length a request may ask for (default 512)",
    )
    add(
        "--max-text-tokens",
        type=int,
        default=1024,
        help="source tokens per text at most (after max_input_length); beyond, 413: the "
        "encoder's memory grows with the square of a text's length (default 1024)",
    )
    add(
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds a request may wait for its translations; then 504 (default 60)",
    )
    add(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish the accepted requests before exiting (default 30)",
    )
    add(
        "--http",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="uvicorn's HTTP parser (default auto: httptools where installed, else h11)",
    )
    add(
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="uvicorn's event loop (default auto: uvloop where installed, else asyncio)",
    )
    add(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default warning)",
    )
    return parser


def check_settings(args):
    """Refuses flags out of range with SystemExit (a message, status 2)."""
    positive = (
        "port workers threads max_batch_sentences max_batch_tokens max_queue_sentences "
        "max_texts max_chars max_beam_size max_decoding_length max_text_tokens"
    ).split()
    for name in positive:
        value = getattr(args, name)
        if value is not None and (value < 1 or (name == "port" and value > 65535)):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a positive integer.")
    for name in ("max_wait_ms", "quiet_ms", "request_timeout", "drain_timeout"):
        value = getattr(args, name)
        if not 0 <= value < math.inf:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a non-negative number.")
    if args.max_queue_sentences < args.max_texts:
        raise SystemExit(
            "error: --max-queue-sentences must be at least --max-texts, or a request of "
            "--max-texts texts could never be queued."
        )
