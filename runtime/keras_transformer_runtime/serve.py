"""Serve translations over HTTP: `keras-transformer-serve ONNX_DIR [--host 127.0.0.1] [--port 8080]`.

Also `python -m keras_transformer_runtime.serve`. A Starlette app run by
uvicorn, on the ONNX Runtime translator (no TensorFlow, no Keras):

- `POST /translate` `{"texts": [...], "beam_size": 4, "length_penalty": 0.6,
  "max_decoding_length": 100, "return_scores": false}` answers
  `{"translations": [...]}` in input order (and `"scores"` when asked);
- `GET /health` (the process is up), `GET /ready` (the model is loaded and
  the queue has room), `GET /metrics` (Prometheus text), `GET
  /openapi.json` (the schema).

The handlers are thin: check the request, tokenize, hand the sentences to
the batcher (`serve_batching.Batcher`), await, answer. The batcher gathers
the sentences of concurrent requests into batches, searched on worker
threads, each with a translator of its own. Every refusal is a JSON
`{"error": message}` with a status a client can act on: 400 (malformed
request), 413 (too many texts or characters), 503 with Retry-After (queue
full), 504 (timed out). docs/serving.md describes the flags and the rules.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import signal
import sys
import time

from keras_transformer_runtime.constraints import sentence_constraints, word_continuations
from keras_transformer_runtime.runtime import (
    ExportFileError,
    OnnxTranslator,
    available_cores,
)
from keras_transformer_runtime.search import encode_prefixes, hypothesis_records
from keras_transformer_runtime.serve_batching import Batcher, BatchLimits, QueueFull
from keras_transformer_runtime.spec import SearchOptions, truncate_source
from keras_transformer_runtime.specials import EOS_ID

# The defaults of keras-transformer-translate.
DEFAULT_BEAM_SIZE = 4
DEFAULT_LENGTH_PENALTY = 0.6
# Tokenizing a request of more texts than this runs on a thread, so that a
# request of thousands of lines does not hold up the event loop.
TOKENIZE_INLINE_TEXTS = 64
MAX_WARNINGS = 10


class Refusal(Exception):
    """A request refused with an HTTP `status` and a message for the client."""

    def __init__(self, status, message, headers=None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


# --------------------------------------------------------------------------- settings


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


# --------------------------------------------------------------------------- model


class Engine:
    """The translators of the workers, and the tokenizer; `run_batch` searches one batch.

    Args:
        onnx_dir, precision, providers: as for `OnnxTranslator`.
        workers: translators (each with its own sessions), one per worker.
        threads: intra-op threads of each.
    """

    def __init__(self, onnx_dir, workers, threads, precision="float32", providers=None):
        self.translators = [
            OnnxTranslator(onnx_dir, providers=providers, num_threads=threads, precision=precision)
            for _ in range(workers)
        ]
        first = self.translators[0]
        if first.tokenizer is None:
            raise ExportFileError(f"The export in {onnx_dir} has no tokenizer file.")
        self.tokenizer = first.tokenizer
        self.max_length = first.max_length
        self.continuations = word_continuations(self.tokenizer)  # for constraints
        self.vocabulary_size = first.vocabulary_size
        self.provider = first.provider

    def encode(self, text, max_input_length=None):
        """Token ids of `text` with EOS (none for an empty or whitespace-only text), and
        whether they were cut to `max_input_length`."""
        ids = self.tokenizer.encode(text) if text.strip() else []
        ids = ids + [EOS_ID] if ids else []
        if max_input_length is not None and len(ids) > max_input_length:
            return truncate_source(ids, max_input_length), True
        return ids, False

    def run_batch(self, worker, options, sentences):
        """Searches `sentences` (`(source ids, prefix ids, index in its request,
        constraints)` each) under
        `options` on worker `worker`'s translator: per sentence its hypothesis records
        (`search.hypothesis_records`), best first."""
        translator = self.translators[worker]
        sources, prefixes, indices, constraints = (
            list(column) for column in zip(*sentences, strict=True)
        )
        found = translator.search(
            sources,
            options,
            prefixes if any(prefixes) else None,
            indices,
            constraints if any(map(len, constraints)) else None,
        )
        decode = translator.tokenizer.decode
        return [hypothesis_records(hypotheses, decode) for hypotheses in found]

    def empty_result(self, options):
        """What a search of an empty source gives (no model call)."""
        return hypothesis_records(
            self.translators[0].search([[]], options)[0], self.tokenizer.decode
        )

    def warm_up(self, batch_sentences):
        """Loads every search graph's session and the split search's copies before serving."""
        source = self.encode("a a a")[0] or [EOS_ID]
        sentences = [(source, [], i, []) for i in range(max(batch_sentences, 1))]
        for worker in range(len(self.translators)):
            for beam_size in (1, DEFAULT_BEAM_SIZE):
                options = SearchOptions(beam_size=beam_size, max_length=2)
                self.run_batch(worker, options, sentences)
                self.run_batch(worker, options, sentences[:1])


# --------------------------------------------------------------------------- requests


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The search options a request may set, with the JSON type each takes; their
# names, meanings and defaults are `spec.SearchOptions`'s and the translate
# commands' flags' (docs/decoding.md).
OPTION_TYPES = {
    "beam_size": (_is_int, "an integer"),
    "length_penalty": (_is_number, "a number"),
    "n_best": (_is_int, "an integer"),
    "max_length": (_is_int, "an integer"),
    "min_length": (_is_int, "an integer"),
    "disable_unk": (lambda v: isinstance(v, bool), "true or false"),
    "repetition_penalty": (_is_number, "a number"),
    "no_repeat_ngram_size": (_is_int, "an integer"),
    "sampling_topk": (_is_int, "an integer"),
    "sampling_topp": (_is_number, "a number"),
    "sampling_temperature": (_is_number, "a number"),
    "seed": (_is_int, "an integer"),
    "max_input_length": (_is_int, "an integer"),
    "token_scores": (lambda v: isinstance(v, bool), "true or false"),
    "alignment": (lambda v: isinstance(v, bool), "true or false"),
}
OPTION_HELP = {
    "beam_size": "live hypotheses kept; 1 is greedy search (or sampling)",
    "length_penalty": "beam search's alpha: scores divided by ((5 + length) / 6) ** alpha",
    "n_best": "hypotheses answered per text, best first (at most beam_size)",
    "max_length": "most output tokens per sentence, EOS included; null: the source length + 50",
    "min_length": "EOS is not allowed before this many tokens",
    "disable_unk": "never generate the unknown token",
    "repetition_penalty": "> 1 makes tokens already generated less likely",
    "no_repeat_ngram_size": "no n-gram of this size twice in an output (0: off)",
    "sampling_topk": "1: search; 0: sample from every token; k > 1: from the k best",
    "sampling_topp": "sample from the smallest set of this probability mass",
    "sampling_temperature": "sampling divides the log-probabilities by this",
    "seed": "sampling: text i of the request draws from a generator seeded (seed, i)",
    "max_input_length": "sources longer than this many tokens are truncated (with a warning)",
    "token_scores": "answer hypotheses with each token's log-probability",
    "alignment": "answer hypotheses with each token's most attended source position",
}
REQUEST_FIELDS = (
    "texts",
    "prefixes",
    "constraints",
    *OPTION_TYPES,
    "max_decoding_length",
    "suppress",
    "return_scores",
)


def _strings(data, name, required=False):
    value = data.get(name)
    if value is None:
        if required:
            raise Refusal(400, f'the field "{name}" (a list of strings) is missing or null')
        return None
    if not isinstance(value, list):
        raise Refusal(400, f'"{name}" must be a list of strings, not {_json_type(value)}')
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise Refusal(400, f'"{name}"[{i}] must be a string, not {_json_type(item)}')
    return value


def parse_request(data, settings, tokenizer):
    """The checked fields of a decoded JSON body:
    `(texts, prefixes, constraints, options, return_scores)`.

    `options` is a `spec.SearchOptions`; `prefixes` is None or one text per
    text; `constraints` None or per text a list of phrases (or None). Raises `Refusal` 400 for a wrong shape, type or value, 413 for too
    many texts or characters.
    """
    if not isinstance(data, dict):
        raise Refusal(400, f"the body must be a JSON object, not {_json_type(data)}")
    unknown = sorted(set(data) - set(REQUEST_FIELDS))
    if unknown:
        raise Refusal(
            400,
            f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
            f"{', '.join(REQUEST_FIELDS)}",
        )
    texts = _strings(data, "texts", required=True)
    if len(texts) > settings.max_texts:
        raise Refusal(
            413,
            f"{len(texts)} texts in one request; this server takes at most "
            f"{settings.max_texts} (--max-texts): split the request",
        )
    prefixes = _strings(data, "prefixes")
    if prefixes is not None and len(prefixes) != len(texts):
        raise Refusal(
            400, f'{len(prefixes)} "prefixes" for {len(texts)} texts: give one each ("" for none)'
        )
    suppress = _strings(data, "suppress") or []
    constraints = data.get("constraints")
    if constraints is not None:
        if not isinstance(constraints, list) or len(constraints) != len(texts):
            raise Refusal(
                400,
                '"constraints" must be a list with one entry per text: a list of target '
                "phrases, or null or [] for none",
            )
        for i, entry in enumerate(constraints):
            if entry is not None and (
                not isinstance(entry, list) or not all(isinstance(p, str) for p in entry)
            ):
                raise Refusal(400, f'"constraints"[{i}] must be a list of strings or null')
    phrases = [p for entry in constraints or () for p in entry or ()]
    chars = sum(map(len, texts)) + sum(map(len, prefixes or ())) + sum(map(len, suppress))
    chars += sum(map(len, phrases))
    if chars > settings.max_chars:
        raise Refusal(
            413,
            f"{chars} characters in one request; this server takes at most "
            f"{settings.max_chars} (--max-chars): split the request",
        )
    if "max_decoding_length" in data:
        if "max_length" in data:
            raise Refusal(
                400, 'give "max_length" or its other name "max_decoding_length", not both'
            )
        data = dict(data, max_length=data["max_decoding_length"])
    values = {"beam_size": DEFAULT_BEAM_SIZE, "length_penalty": DEFAULT_LENGTH_PENALTY}
    for name, (check, kind) in OPTION_TYPES.items():
        value = data.get(name)
        if value is None:
            continue
        if not check(value) or (_is_number(value) and not math.isfinite(value)):
            raise Refusal(400, f'"{name}" must be {kind}. Received: {json.dumps(value)}')
        values[name] = value
    if not 1 <= values["beam_size"] <= settings.max_beam_size:
        raise Refusal(
            400,
            f'"beam_size" must be an integer from 1 (greedy) to {settings.max_beam_size}. '
            f"Received: {values['beam_size']}",
        )
    max_length = values.get("max_length")
    if max_length is not None and not 1 <= max_length <= settings.max_decoding_length:
        raise Refusal(
            400,
            f'"max_length" must be an integer from 1 to {settings.max_decoding_length} '
            f"(or null: the source length + 50). Received: {max_length}",
        )
    return_scores = data.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise Refusal(
            400, f'"return_scores" must be true or false. Received: {json.dumps(return_scores)}'
        )
    sequences = []
    for text in suppress:
        ids = tokenizer.encode(text)
        if not ids:
            raise Refusal(400, f'"suppress" holds {text!r}, which has no tokens')
        sequences.append(ids)
    if values["beam_size"] == 1:
        # Greedy search has no length penalty: greedy requests share batches whatever they say.
        values["length_penalty"] = DEFAULT_LENGTH_PENALTY
    try:
        options = SearchOptions(suppress_sequences=sequences, **values)
    except ValueError as error:
        raise Refusal(400, str(error)) from None
    return texts, prefixes, constraints, options, return_scores


def _json_type(value):
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def decode_body(body):
    """The JSON text of `body`, and a warning when it was not valid UTF-8.

    As `keras-transformer-translate` reads its input: undecodable bytes read
    as U+FFFD, the request is translated, and the answer says so.
    """
    try:
        return body.decode("utf-8"), None
    except UnicodeDecodeError:
        return body.decode("utf-8", errors="replace"), (
            "the request body is not valid UTF-8; its undecodable bytes read as U+FFFD"
        )


def clean_texts(texts):
    """`texts` with lone surrogates (JSON escapes such as \\ud800) as U+FFFD, and their indices."""
    replaced = []
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            texts[i] = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            replaced.append(i)
    return replaced


def _json_response(status, payload, headers=None):
    from starlette.responses import Response

    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _error(status, message, headers=None):
    return _json_response(status, {"error": message}, headers)


# --------------------------------------------------------------------------- app


def create_app(engine, settings):
    """The Starlette app serving `engine` under `settings` (the parsed flags)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response
    from starlette.routing import Route

    from keras_transformer_runtime.serve_metrics import CONTENT_TYPE_LATEST, ServeMetrics

    workers = len(engine.translators)
    limits = BatchLimits(
        max_batch_sentences=settings.max_batch_sentences,
        max_batch_tokens=settings.max_batch_tokens,
        max_wait_ms=settings.max_wait_ms,
        quiet_ms=settings.quiet_ms,
        max_queue_sentences=settings.max_queue_sentences,
    )
    state = {}
    metrics = ServeMetrics(
        queued=lambda: state["batcher"].queued_sentences if "batcher" in state else 0,
        running=lambda: state["batcher"].running_batches if "batcher" in state else 0,
    )
    # JSON escapes take up to 6 bytes a character; the rest of a body is small.
    max_body_bytes = 6 * settings.max_chars + 64 * 1024 + 8 * settings.max_texts

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher = Batcher(engine.run_batch, workers, limits, metrics.observe_batch)
        await batcher.start()
        state["batcher"] = batcher
        try:
            yield
        finally:
            await batcher.close()

    async def read_body(request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise Refusal(
                413,
                f"the body has {declared} bytes; this server takes at most {max_body_bytes} "
                "(--max-chars characters as escaped JSON)",
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise Refusal(413, f"the body is over {max_body_bytes} bytes (--max-chars)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def answer(request):
        """`(status, payload, headers, sentences)` of one translation request."""
        body = await read_body(request)
        text, warning = decode_body(body)
        try:
            # A byte order mark and raw tabs or line breaks inside strings are harmless.
            data = json.loads(text.removeprefix("\ufeff"), strict=False)
        except json.JSONDecodeError as error:
            raise Refusal(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise Refusal(400, "the body is not valid JSON: nested too deeply") from None
        texts, prefixes, constraints, options, return_scores = parse_request(
            data, settings, engine.tokenizer
        )
        warnings = [warning] if warning else []
        replaced = clean_texts(texts) + clean_texts(prefixes or [])
        if replaced:
            warnings.append(
                "some texts held lone surrogates (escapes such as \\ud800, not Unicode text); "
                "they read as U+FFFD"
            )

        def prepare():
            encoded = [engine.encode(t, options.max_input_length) for t in texts]
            prefix_ids = (
                encode_prefixes(engine.tokenizer, prefixes, options.max_length)
                if prefixes
                else None
            )
            phrases = None
            if constraints is not None:
                phrases = sentence_constraints(
                    texts,
                    constraints,
                    engine.tokenizer.encode,
                    engine.max_length,
                    options.max_length,
                    lengths=[len(ids) for ids, _ in encoded],  # as truncated
                    continuations=engine.continuations,
                )
            return encoded, prefix_ids, phrases

        try:
            if len(texts) > TOKENIZE_INLINE_TEXTS:
                encoded, prefix_ids, phrases = await asyncio.to_thread(prepare)
            else:
                encoded, prefix_ids, phrases = prepare()
            options.check_ids(engine.vocabulary_size, prefix_ids)
        except ValueError as error:
            # The translator's messages count lines from 1: name the texts as sent.
            message = re.sub(r"\bline (\d+)", lambda m: f"texts[{int(m[1]) - 1}]", str(error))
            raise Refusal(400, message) from None
        sources = [ids for ids, _ in encoded]
        too_long = [i for i, ids in enumerate(sources) if len(ids) > settings.max_text_tokens]
        if too_long:
            i = too_long[0]
            raise Refusal(
                413,
                f"texts[{i}] has {len(sources[i])} tokens; this server takes at most "
                f"{settings.max_text_tokens} per text (--max-text-tokens): split it, or set "
                "max_input_length to truncate it",
            )
        for what, rows, reason in (
            (
                f"max_input_length={options.max_input_length}",
                [i for i, (_, cut) in enumerate(encoded) if cut],
                "truncated",
            ),
            (
                f"the model's max_length={engine.max_length}",
                [i for i, s in enumerate(sources) if len(s) > engine.max_length],
                "translated whole, quality may suffer",
            ),
        ):
            if rows:
                shown = ", ".join(f"texts[{i}]" for i in rows[:MAX_WARNINGS])
                more = ", ..." if len(rows) > MAX_WARNINGS else ""
                warnings.append(f"{shown}{more}: more tokens than {what}; {reason}")
        wanted = [i for i, s in enumerate(sources) if s]
        outputs = [None] * len(texts)
        if len(wanted) < len(texts):
            empty = engine.empty_result(options)
            for i, source in enumerate(sources):
                if not source:
                    outputs[i] = empty
        if wanted:
            batcher = state["batcher"]
            sentences = [
                (sources[i], prefix_ids[i] if prefix_ids else [], i, phrases[i] if phrases else [])
                for i in wanted
            ]
            try:
                ticket = batcher.submit(options, [len(sources[i]) for i in wanted], sentences)
            except QueueFull as error:
                raise Refusal(503, str(error), {"Retry-After": str(error.retry_after)}) from None
            results = await wait_for_ticket(request, batcher, ticket, len(wanted))
            for i, result in zip(wanted, results, strict=True):
                outputs[i] = result
        payload = {"translations": [hypotheses[0]["text"] for hypotheses in outputs]}
        if return_scores:
            payload["scores"] = [hypotheses[0]["score"] for hypotheses in outputs]
        if options.n_best > 1 or options.token_scores or options.alignment:
            payload["hypotheses"] = outputs
        if warnings:
            payload["warnings"] = warnings
        return 200, payload, None, len(texts)

    async def wait_for_ticket(request, batcher, ticket, count):
        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait(
                {ticket.future, watcher},
                timeout=settings.request_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except asyncio.CancelledError:
            batcher.cancel(ticket)
            raise
        finally:
            watcher.cancel()
        if ticket.future in done:
            if ticket.future.cancelled():
                raise Refusal(503, "the request was cancelled")
            error = ticket.future.exception()
            if error is not None:
                raise Refusal(500, f"the search failed: {error}")
            return ticket.future.result()
        batcher.cancel(ticket)
        if watcher in done:
            raise ClientDisconnect()
        raise Refusal(
            504,
            f"the {count} sentences were not translated within {settings.request_timeout:g} "
            "seconds (--request-timeout); the server is overloaded: retry later or send fewer",
        )

    async def translate(request):
        started = time.perf_counter()
        sentences = 0
        try:
            status, payload, headers, sentences = await answer(request)
            response = _json_response(status, payload, headers)
        except Refusal as refusal:
            status = refusal.status
            response = _error(refusal.status, str(refusal), refusal.headers)
        except ClientDisconnect:
            status = 499  # nginx's name for it; nobody reads this answer
            response = Response(status_code=204)
        metrics.observe_request(status, time.perf_counter() - started, sentences)
        return response

    async def health(request):
        return _json_response(200, {"status": "ok"})

    async def ready(request):
        batcher = state.get("batcher")
        if batcher is None:
            return _error(503, "not started")
        if batcher.is_full():
            return _error(
                503,
                f"the queue is full ({batcher.queued_sentences} sentences wait)",
                {"Retry-After": "1"},
            )
        return _json_response(
            200,
            {
                "status": "ready",
                "provider": engine.provider,
                "workers": workers,
                "queued_sentences": batcher.queued_sentences,
            },
        )

    async def metrics_page(request):
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    schema = openapi_schema(settings)

    async def openapi(request):
        return _json_response(200, schema)

    async def not_found(request, exc):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    async def server_error(request, exc):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    from starlette.exceptions import HTTPException

    app = Starlette(
        routes=[
            Route("/translate", translate, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics_page, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: not_found, Exception: server_error},
    )
    app.state.metrics = metrics
    return app


def openapi_schema(settings):
    """The OpenAPI 3.1 document of the server's endpoints (`GET /openapi.json`)."""
    error = {
        "type": "object",
        "properties": {"error": {"type": "string", "description": "what was wrong"}},
        "required": ["error"],
    }

    def error_response(description):
        return {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    request = {
        "type": "object",
        "required": ["texts"],
        "additionalProperties": False,
        "properties": {
            "texts": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": settings.max_texts,
                "description": "sentences to translate, one translation each, in order; an "
                f"empty string translates to an empty string; at most {settings.max_chars} "
                "characters in all",
            },
            "prefixes": {
                "type": "array",
                "items": {"type": "string"},
                "description": 'target prefixes, one per text ("" for none): each '
                "translation starts with its prefix",
            },
            "constraints": {
                "type": "array",
                "items": {"type": ["array", "null"], "items": {"type": "string"}},
                "description": "one entry per text: target phrases its translation must hold "
                "(docs/constraints.md), or null or [] for none",
            },
            "suppress": {
                "type": "array",
                "items": {"type": "string"},
                "description": "words or phrases never generated (their tokens in a row)",
            },
            "return_scores": {
                "type": "boolean",
                "default": False,
                "description": "also answer each translation's score (greedy: summed "
                "log-probability; beam: length-penalized)",
            },
            "max_decoding_length": {
                "type": ["integer", "null"],
                "description": "another name of max_length",
            },
        },
    }
    described = request["properties"]
    kinds = {"an integer": "integer", "a number": "number", "true or false": "boolean"}
    defaults = SearchOptions()
    for name, (_, kind) in OPTION_TYPES.items():
        entry = {"type": kinds[kind], "description": OPTION_HELP[name]}
        default = getattr(defaults, name)
        if default is not None:
            entry["default"] = default
        described.setdefault(name, entry)
    described["beam_size"]["maximum"] = settings.max_beam_size
    described["max_length"]["maximum"] = settings.max_decoding_length
    described["max_length"]["type"] = ["integer", "null"]
    response = {
        "type": "object",
        "required": ["translations"],
        "properties": {
            "translations": {"type": "array", "items": {"type": "string"}},
            "scores": {"type": "array", "items": {"type": "number"}},
            "hypotheses": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "object"}},
                "description": "with n_best > 1, token_scores or alignment: per text its "
                "hypotheses, best first, each {text, score, log_prob[, token_scores][, alignment]}",
            },
            "warnings": {
                "type": "array",
                "items": {"type": "string"},
                "description": "input that was translated but not as sent (invalid UTF-8, "
                "texts longer than the model's max_length)",
            },
        },
    }
    json_body = {"content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "keras-transformer-serve", "version": "1"},
        "paths": {
            "/translate": {
                "post": {
                    "summary": "Translate texts; concurrent requests are batched together",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/TranslateRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "the translations, in input order",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/TranslateResponse"}
                                }
                            },
                        },
                        "400": error_response("malformed JSON, a wrong type or value"),
                        "413": error_response("too many texts or characters"),
                        "503": error_response("the queue is full; see Retry-After"),
                        "504": error_response("not translated within --request-timeout"),
                    },
                }
            },
            "/health": {"get": {"summary": "The process is up", "responses": {"200": json_body}}},
            "/ready": {
                "get": {
                    "summary": "The model is loaded and the queue has room",
                    "responses": {"200": json_body, "503": error_response("the queue is full")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus text exposition",
                    "responses": {"200": {"content": {"text/plain": {}}}},
                }
            },
        },
        "components": {
            "schemas": {
                "TranslateRequest": request,
                "TranslateResponse": response,
                "Error": error,
            }
        },
    }


# --------------------------------------------------------------------------- main


def _exit_quietly(signum, frame):
    # uvicorn drains on SIGTERM and SIGINT, then raises the signal again with
    # the handler it found: this one, so that a drained server exits with 0.
    raise SystemExit(0)


def _http_stack(http, loop) -> str:
    """The parser and event loop that uvicorn's "auto" picks: the fast ones where installed."""
    import importlib.util

    def installed(name):
        return importlib.util.find_spec(name) is not None

    if http == "auto":
        http = "httptools" if installed("httptools") else "h11"
    if loop == "auto":
        loop = "uvloop" if installed("uvloop") and sys.platform != "win32" else "asyncio"
    return f"{http} on {loop}"


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_settings(args)
    try:
        import uvicorn
    except ImportError:
        raise SystemExit(
            "error: keras-transformer-serve needs starlette, uvicorn and prometheus-client: "
            'pip install "keras-transformer-runtime[serve]"'
        ) from None
    providers = ["CPUExecutionProvider"] if args.cpu else None
    try:
        probe = OnnxTranslator(args.onnx_dir, providers=providers, precision=args.precision)
        on_cpu = probe.provider == "CPUExecutionProvider"
        del probe
        cores = available_cores()
        workers = args.workers or 1
        threads = args.threads or (max(1, cores // workers) if on_cpu else None)
        engine = Engine(args.onnx_dir, workers, threads, args.precision, providers)
        engine.warm_up(min(args.max_batch_sentences, 16))
    except (ExportFileError, ValueError, OSError) as error:
        raise SystemExit(f"error: cannot load the model: {error}") from None
    app = create_app(engine, args)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=args.http,
        loop=args.loop,
        lifespan="on",
        access_log=False,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    signal.signal(signal.SIGTERM, _exit_quietly)
    signal.signal(signal.SIGINT, _exit_quietly)
    print(
        f"keras-transformer-serve: {args.onnx_dir} on {engine.provider}, {workers} worker(s) "
        f"of {threads or 'default'} thread(s), {_http_stack(args.http, args.loop)}, "
        f"http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if not server.started:
        raise SystemExit(f"error: could not listen on {args.host}:{args.port}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
