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

import asyncio
import contextlib
import json
import re
import signal
import sys
import time

from keras_transformer_runtime.constraints import sentence_constraints
from keras_transformer_runtime.documents import rebuild_documents, sentence_terms
from keras_transformer_runtime.export_format import ExportFileError
from keras_transformer_runtime.onnx_sessions import available_cores
from keras_transformer_runtime.onnx_translator import OnnxTranslator
from keras_transformer_runtime.serve_batching import Batcher, BatchLimits, QueueFull
from keras_transformer_runtime.serve_engine import Engine
from keras_transformer_runtime.serve_requests import (
    Refusal,
    clean_texts,
    decode_body,
    openapi_schema,
    parse_request,
)
from keras_transformer_runtime.serve_settings import build_parser, check_settings
from keras_transformer_runtime.text_batches import encode_prefixes

# Tokenizing a request of more texts (splitting documents of more characters)
# than this runs on a thread, so that a big request does not hold up the event loop.
TOKENIZE_INLINE_TEXTS = 64
TOKENIZE_INLINE_CHARS = 20000
MAX_WARNINGS = 10


def _json_response(status, payload, headers=None):
    from starlette.responses import Response

    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _error(status, message, headers=None):
    return _json_response(status, {"error": message}, headers)


# --------------------------------------------------------------------------- app


async def _maybe_threaded(threaded, function, *args):
    """`function(*args)`, on a worker thread if `threaded`."""
    if threaded:
        return await asyncio.to_thread(function, *args)
    return function(*args)


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
        texts, prefixes, constraints, options, return_scores, document = parse_request(
            data, settings, engine.tokenizer
        )
        warnings = [warning] if warning else []
        replaced = clean_texts(texts) + clean_texts(prefixes or [])
        if replaced:
            warnings.append(
                "some texts held lone surrogates (escapes such as \\ud800, not Unicode text); "
                "they read as U+FFFD"
            )
        input_format, language, terms = document
        docs, where = None, "texts[{}]".format
        if input_format != "text":
            # Documents: their sentences go on as the texts, and come back as documents.
            docs = await _maybe_threaded(
                sum(map(len, texts)) > TOKENIZE_INLINE_CHARS,
                engine.documents,
                texts,
                input_format,
                language,
                options.max_input_length,
            )
            places = [(d, k) for d, doc in enumerate(docs) for k in range(len(doc.sentences))]
            texts = [sentence for doc in docs for sentence in doc.sentences]

            def where(i):
                return f"texts[{places[i][0]}] (its sentence {places[i][1] + 1})"

        if terms:  # the glossary's phrases, for each sentence that holds a source term
            constraints = sentence_terms(texts, terms)

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
                    encode_target=engine.tokenizer.encode_target,
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
            message = re.sub(r"\bline (\d+)", lambda m: where(int(m[1]) - 1), str(error))
            raise Refusal(400, message) from None
        sources = [ids for ids, _ in encoded]
        too_long = [i for i, ids in enumerate(sources) if len(ids) > settings.max_text_tokens]
        if too_long:
            i = too_long[0]
            raise Refusal(
                413,
                f"{where(i)} has {len(sources[i])} tokens; this server takes at most "
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
                shown = ", ".join(where(i) for i in rows[:MAX_WARNINGS])
                more = ", ..." if len(rows) > MAX_WARNINGS else ""
                warnings.append(f"{shown}{more}: more tokens than {what}; {reason}")
        wanted = [i for i, s in enumerate(sources) if s]
        outputs = [None] * len(texts)
        if len(wanted) < len(texts):
            empty = engine.empty_result(options)
            for i, source in enumerate(sources):
                if not source:
                    outputs[i] = empty
        # In HTML and Markdown, the sentences with inline tags need their word links.
        tagged = [f for doc in docs for f in doc.tagged] if docs else [False] * len(texts)
        if wanted:
            batcher = state["batcher"]
            sentences = [
                (
                    sources[i],
                    prefix_ids[i] if prefix_ids else [],
                    i,
                    phrases[i] if phrases else [],
                    texts[i] if tagged[i] else None,
                )
                for i in wanted
            ]
            try:
                ticket = batcher.submit(options, [len(sources[i]) for i in wanted], sentences)
            except QueueFull as error:
                raise Refusal(503, str(error), {"Retry-After": str(error.retry_after)}) from None
            results = await wait_for_ticket(request, batcher, ticket, len(wanted))
            for i, result in zip(wanted, results, strict=True):
                outputs[i] = result
        translations = [hypotheses[0]["text"] for hypotheses in outputs]
        if docs is not None:
            links = [hypotheses[0].get("links") for hypotheses in outputs]
            translations = rebuild_documents(docs, translations, links)
        payload = {"translations": translations}
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
        shortlist = False if args.no_shortlist else None
        engine = Engine(args.onnx_dir, workers, threads, args.precision, providers, shortlist)
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
