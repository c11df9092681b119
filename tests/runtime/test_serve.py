"""`keras-transformer-serve` as its users meet it: real server processes on
127.0.0.1 with a tiny real export, spoken to over HTTP.

The batching rule itself is tested without HTTP in test_serve_batching.py."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from keras_transformer_runtime import OnnxTranslator
from keras_transformer_runtime.options import SearchOptions, option_fields

pytestmark = pytest.mark.integration

STARTUP_SECONDS = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, headers=None, timeout=60):
    """`(status, headers, body bytes)` of one request on a new connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def post(port, payload, timeout=60):
    """`(status, decoded JSON answer, headers)` of `POST /translate` (bytes are sent as they are)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, headers, data = request(
        port, "POST", "/translate", body, {"Content-Type": "application/json"}, timeout
    )
    assert headers["content-type"] == "application/json"
    return status, json.loads(data), headers


class Server:
    """`python -m keras_transformer_runtime.serve EXPORT FLAGS` on a free port, up once /health answers."""

    def __init__(self, export, *flags, log_dir):
        self.port = free_port()
        self.log = open(os.path.join(log_dir, f"serve-{self.port}.log"), "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "keras_transformer_runtime.serve", export]
            + ["--port", str(self.port), "--log-level", "info", *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited: {self.output()}")
            try:
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the server did not start: {self.output()}"
            time.sleep(0.2)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self):
        from prometheus_client.parser import text_string_to_metric_families

        status, _, body = request(self.port, "GET", "/metrics")
        assert status == 200
        return {
            sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
        }

    def queued(self):
        return self.metrics()["kt_serve_queue_sentences{}"]

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self.log.close()


def wait_until(condition, seconds=30, what="the condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_export, tmp_path_factory):
    """One worker, a long batch wait (so that concurrent requests surely meet), small limits."""
    export, _ = tiny_export
    flags = ["--workers", "1", "--threads", "1", "--max-wait-ms", "300"]
    flags += ["--max-texts", "50", "--max-chars", "2000", "--max-beam-size", "8"]
    flags += ["--max-text-tokens", "64"]
    running = Server(export, *flags, log_dir=tmp_path_factory.mktemp("serve"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def translator(tiny_export):
    return OnnxTranslator(tiny_export[0], num_threads=1)


TEXTS = ["ka ko", "", "li lo mina", "  ", "VUX WEN YOR", "mina", "ko ka li lo", "tel"]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translations_are_the_translators_in_input_order(server, translator, beam_size):
    status, answer, _ = post(
        server.port,
        {"texts": TEXTS, "beam_size": beam_size, "max_decoding_length": 20, "return_scores": True},
    )
    assert status == 200, answer
    expected = translator.translate(TEXTS, beam_size=beam_size, max_length=20)
    assert answer["translations"] == expected
    assert answer["translations"][1] == answer["translations"][3] == ""
    assert len(answer["scores"]) == len(TEXTS) and answer["scores"][1] == 0.0
    assert "warnings" not in answer
    if beam_size == 1:  # the summed log-probabilities of the search
        sources = [translator.tokenizer.encode(t) + [2] for t in TEXTS if t.strip()]
        _, scores = translator.greedy_search(sources, max_length=20)
        nonempty = [s for t, s in zip(TEXTS, answer["scores"], strict=True) if t.strip()]
        assert nonempty == pytest.approx(list(scores), abs=1e-5)


@pytest.mark.parametrize(
    ("options", "prefixes"),
    [
        (dict(beam_size=4, n_best=2, token_scores=True, max_length=12, min_length=2), None),
        (dict(beam_size=1, sampling_topk=0, seed=7, no_repeat_ngram_size=2), True),
        (dict(beam_size=2, alignment=True), None),
    ],
)
def test_decoding_options_answer_as_the_translator(server, translator, options, prefixes):
    if prefixes:
        prefixes = ["ko" if i % 2 else "" for i in range(len(TEXTS))]
    request = {"texts": TEXTS, **options, "return_scores": True}
    if prefixes:
        request["prefixes"] = prefixes
    status, answer, _ = post(server.port, request)
    assert status == 200, answer
    expected = translator.translate_hypotheses(TEXTS, SearchOptions(**options), prefixes)
    assert answer["translations"] == [hypotheses[0]["text"] for hypotheses in expected]
    assert answer["scores"] == pytest.approx([h[0]["score"] for h in expected], abs=1e-5)
    if options.get("alignment"):
        got = answer["hypotheses"]
        assert [hs[0]["alignment"] for hs in got] == [hs[0]["alignment"] for hs in expected]
        assert any(hs[0]["alignment"] for hs in got)
    elif options.get("n_best", 1) > 1:
        got = answer["hypotheses"]
        assert [[h["text"] for h in hs] for hs in got] == [
            [h["text"] for h in hs] for hs in expected
        ]
        assert [len(hs[0]["token_scores"]) for hs in got] == [
            len(hs[0]["token_scores"]) for hs in expected
        ]
    else:
        assert "hypotheses" not in answer
        prefixed = [i for i, p in enumerate(prefixes) if p and TEXTS[i].strip()]
        assert prefixed and all(answer["translations"][i].startswith("ko") for i in prefixed)


def test_constrained_translations_are_the_translators(server, translator):
    constraints = [["ko"] if i % 3 == 0 else None for i in range(len(TEXTS))]
    request = {"texts": TEXTS, "beam_size": 2, "max_length": 12, "constraints": constraints}
    status, answer, _ = post(server.port, request)
    assert status == 200, answer
    expected = translator.translate(
        TEXTS, options=SearchOptions(beam_size=2, max_length=12), constraints=constraints
    )
    assert answer["translations"] == expected
    held = [i for i, c in enumerate(constraints) if c and TEXTS[i].strip()]
    assert held and all("ko" in answer["translations"][i].split() for i in held)


def test_concurrent_requests_share_one_batch(server, translator):
    before = server.metrics()
    texts = TEXTS[:3] + TEXTS[4:]
    answers = [None] * len(texts)
    barrier = threading.Barrier(len(texts))

    def client(i):
        barrier.wait()
        answers[i] = post(server.port, {"texts": [texts[i]], "beam_size": 1})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [a[1]["translations"][0] for a in answers] == translator.translate(texts, beam_size=1)
    after = server.metrics()
    batches = after["kt_serve_batch_sentences_count{}"] - before["kt_serve_batch_sentences_count{}"]
    searched = after["kt_serve_batch_sentences_sum{}"] - before["kt_serve_batch_sentences_sum{}"]
    assert searched == len(texts) - 1  # the empty text is answered without a search
    assert batches < searched  # some batch held the sentences of several requests
    ok = 'kt_serve_requests_total{"status": "200"}'
    assert after[ok] - before[ok] == len(texts)


REFUSALS = [
    (b'{"texts": ["a"', 400, "the body is not valid JSON"),
    (b'["a"]', 400, "the body must be a JSON object, not a list"),
    ({"text": ["a"]}, 400, "unknown field(s) 'text'"),
    ({"beam_size": 2}, 400, 'the field "texts" (a list of strings) is missing'),
    ({"texts": "a b"}, 400, '"texts" must be a list, not a string'),
    ({"texts": ["a", 3]}, 400, '"texts"[1] must be a string, not an integer'),
    ({"texts": ["a"], "beam_size": 0}, 400, '"beam_size" must be an integer from 1'),
    ({"texts": ["a"], "beam_size": True}, 400, '"beam_size" must be an integer, not true'),
    ({"texts": ["a"], "beam_size": 9}, 400, "from 1 (greedy) to 8. Received: 9"),
    ({"texts": ["a"], "length_penalty": -1}, 400, "length_penalty must be a non-negative"),
    ({"texts": ["a"], "length_penalty": "0.6"}, 400, '"length_penalty" must be'),
    ({"texts": ["a"], "max_decoding_length": 0}, 400, '"max_length" must be an integer from 1'),
    ({"texts": ["a"], "n_best": 5}, 400, "n_best must be at most beam_size"),
    ({"texts": ["a"], "sampling_topk": 5}, 400, "it needs beam_size=1"),
    ({"texts": ["a", "b"], "prefixes": ["a"]}, 400, '1 "prefixes" for 2 texts'),
    ({"texts": ["a"], "suppress": [" "]}, 400, "which has no tokens"),
    ({"texts": ["a"], "seed": 1.5}, 400, '"seed" must be an integer, not a number'),
    ({"texts": ["a"], "constraints": [["ko"], []]}, 400, '"constraints" must be a list with one'),
    ({"texts": ["a"], "constraints": [[3]]}, 400, '"constraints"[0][0] must be a string'),
    ({"texts": ["", "ka"], "constraints": [None, ["qqq"]]}, 400, "texts[1]"),
    (
        {"texts": ["ka", "ko"], "prefixes": ["", "ko ka ko ka"], "max_decoding_length": 3},
        400,
        "the target prefix of texts[1] ('ko ka ko ka') is",
    ),
    ({"texts": ["a"], "return_scores": "yes"}, 400, '"return_scores" must be true or false'),
    ({"texts": ["a"] * 51}, 413, "51 texts in one request; this server takes at most 50"),
    ({"texts": ["a" * 80_000]}, 413, "bytes; this server takes at most"),
    ({"texts": ["ok", "ka " * 70]}, 413, "texts[1] has 71 tokens; this server takes at most 64"),
    (b"[" * 20_000 + b"]" * 20_000, 400, "the body is not valid JSON: nested too deeply"),
    ({"texts": ["abcd " * 401]}, 413, "2005 characters in one request"),
    ({"texts": ["a"], "format": "pdf"}, 400, '"format" must be one of text, paragraphs'),
    ({"texts": ["a"], "format": 1}, 400, '"format" must be a string, not an integer'),
    (
        {"texts": ["a. b."], "format": "paragraphs", "beam_size": 2, "n_best": 2},
        400,
        '"n_best" is for sentences ("format": "text")',
    ),
    ({"texts": ["a"], "format": "paragraphs", "prefixes": ["ko"]}, 400, '"prefixes" is for'),
    ({"texts": ["a"], "terms": [["a"]]}, 400, "\"terms\": term 1 (['a']) must be a source"),
    ({"texts": ["a"], "terms": [["a", "b"]], "constraints": [[]]}, 400, "not both"),
    ({"texts": ["ka. " * 501], "format": "paragraphs"}, 413, "2004 characters in one request"),
    (
        {"texts": ["ok.", "ok? " + "ka " * 70], "format": "paragraphs"},
        413,
        "texts[1] (its sentence 2) has 71 tokens; this server takes at most 64",
    ),
]


def test_documents_answer_as_the_translators(server, translator):
    texts = ["ka ko. li lo!\n\n  mina tel?\r\n", "", "  \n", "tel ka li. lo"]
    request = {"texts": texts, "format": "paragraphs", "beam_size": 2, "max_length": 10}
    status, answer, _ = post(server.port, {**request, "source_language": "de"})
    assert status == 200, answer
    options = SearchOptions(beam_size=2, max_length=10)
    expected = translator.translate_documents(texts, "paragraphs", options, language="de")
    assert answer["translations"] == expected
    assert answer["translations"][2] == "  \n" and "\n\n  " in answer["translations"][0]
    status, answer, _ = post(server.port, {**request, "format": "text"})
    assert answer["translations"] == translator.translate(texts, options=options)
    pages = ['<p class="a">ka <b>ko</b> li. lo &amp; mina!</p><code>ko</code>', "", "<p>tel</p>"]
    status, answer, _ = post(server.port, {**request, "texts": pages, "format": "html"})
    assert status == 200, answer
    assert answer["translations"] == translator.translate_documents(pages, "html", options)
    assert "hypotheses" not in answer and "<code>ko</code>" in answer["translations"][0]
    glossary = {"texts": texts, "terms": [["ka", "YOR JUL"]], "beam_size": 3, "max_length": 10}
    status, answer, _ = post(server.port, {**glossary, "format": "paragraphs"})
    assert status == 200, answer
    expected = translator.translate_documents(
        texts, "paragraphs", SearchOptions(beam_size=3, max_length=10), terms=[("ka", "YOR JUL")]
    )
    assert answer["translations"] == expected and "YOR JUL" in expected[0]
    status, answer, _ = post(server.port, glossary)  # text: each text is one sentence
    assert answer["translations"][0].count("YOR JUL") >= 1


@pytest.mark.parametrize(("payload", "status", "message"), REFUSALS)
def test_each_refusal_is_a_json_error_and_the_server_goes_on(server, payload, status, message):
    got, answer, _ = post(server.port, payload)
    assert got == status
    assert message in answer["error"]
    assert post(server.port, {"texts": ["ka"], "beam_size": 1})[0] == 200


def test_unknown_paths_and_methods_answer_json_errors(server):
    status, _, body = request(server.port, "GET", "/translate")
    assert status == 405 and "Method Not Allowed" in json.loads(body)["error"]
    status, _, body = request(server.port, "GET", "/nowhere")
    assert status == 404 and "/nowhere" in json.loads(body)["error"]


def test_empty_requests_and_undecodable_text(server, translator):
    assert post(server.port, {"texts": []})[1] == {"translations": []}
    assert post(server.port, {"texts": ["", " "]})[1] == {"translations": ["", ""]}
    assert post(server.port, b'\xef\xbb\xbf{"texts": [""]}')[1] == {"translations": [""]}
    assert post(server.port, b'{"texts": ["\t"]}')[1] == {"translations": [""]}  # a raw tab
    status, answer, _ = post(server.port, {"texts": ["ka ko li lo"], "max_input_length": 2})
    assert status == 200
    assert answer["warnings"] == ["texts[0]: more tokens than max_input_length=2; truncated"]
    assert answer["translations"] == translator.translate(
        ["ka"], options=SearchOptions(max_input_length=2)
    )
    # Invalid UTF-8 reads as U+FFFD, as keras-transformer-translate reads it, and the answer says so.
    status, answer, _ = post(server.port, b'{"texts": ["ka \xff ko", "mina"], "beam_size": 1}')
    assert status == 200
    assert answer["translations"] == translator.translate(["ka \ufffd ko", "mina"], beam_size=1)
    assert "not valid UTF-8" in answer["warnings"][0]
    status, answer, _ = post(server.port, b'{"texts": ["ka \\ud800 ko"], "beam_size": 1}')
    assert status == 200 and "lone surrogates" in answer["warnings"][0]
    assert answer["translations"] == translator.translate(["ka \ufffd ko"], beam_size=1)


def test_health_ready_schema_and_metrics(server):
    status, _, body = request(server.port, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = request(server.port, "GET", "/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"
    status, _, body = request(server.port, "GET", "/openapi.json")
    schema = json.loads(body)
    assert status == 200 and schema["openapi"].startswith("3.")
    fields = schema["components"]["schemas"]["TranslateRequest"]["properties"]
    assert {"texts", "prefixes", "beam_size", "n_best", "sampling_topk", "seed"} <= set(fields)
    # Every search option is a field, described by its own help, with its default.
    for option in option_fields():
        assert fields[option.name]["description"].startswith(option.help)
        assert fields[option.name].get("default") == option.default
    assert fields["beam_size"]["maximum"] == 8 and "maxItems" in fields["texts"]
    metrics = server.metrics()  # parses as Prometheus text
    for name in (
        "kt_serve_sentences_total{}",
        "kt_serve_batch_sentences_count{}",
        "kt_serve_queue_sentences{}",
        "kt_serve_running_batches{}",
        "kt_serve_batch_seconds_count{}",
        "kt_serve_queue_wait_seconds_count{}",
    ):
        assert name in metrics
    assert any(name.startswith("kt_serve_request_seconds_bucket") for name in metrics)


@pytest.fixture(scope="module")
def slow_server(tiny_export, tmp_path_factory):
    """One sentence per batch, a small queue and a short timeout: a server easily full."""
    export, _ = tiny_export
    flags = ["--workers", "1", "--threads", "1", "--max-wait-ms", "0"]
    flags += ["--max-batch-sentences", "1", "--max-texts", "200", "--max-queue-sentences", "200"]
    flags += ["--request-timeout", "2"]
    running = Server(export, *flags, log_dir=tmp_path_factory.mktemp("serve"))
    yield running
    running.stop()


def endless_request(endless, count):
    """A request of `count` sentences that each decode to 512 tokens."""
    return {"texts": [endless] * count, "beam_size": 1, "max_decoding_length": 512}


def test_a_timed_out_request_gets_504_and_leaves_the_queue(slow_server, tiny_export):
    status, answer, _ = post(slow_server.port, endless_request(tiny_export[1], 200))
    assert status == 504
    assert "not translated within 2 seconds" in answer["error"]
    wait_until(lambda: slow_server.queued() == 0, what="the queue emptying")
    assert request(slow_server.port, "GET", "/ready")[0] == 200


def test_a_full_queue_gives_503_and_a_client_gone_leaves_it(slow_server, tiny_export):
    endless = tiny_export[1]
    # A client that sends a request filling the queue, then leaves without reading.
    body = json.dumps(endless_request(endless, 200)).encode()
    gone = socket.create_connection(("127.0.0.1", slow_server.port))
    gone.sendall(
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: slow_server.queued() >= 190, what="the queue filling")
    status, answer, headers = post(slow_server.port, endless_request(endless, 20))
    assert status == 503
    assert "the queue is full" in answer["error"]
    assert int(headers["retry-after"]) >= 1
    gone.close()
    wait_until(lambda: slow_server.queued() == 0, what="the queue emptying")
    status, answer, _ = post(slow_server.port, {"texts": ["ka ko"], "beam_size": 1})
    assert status == 200
    metrics = slow_server.metrics()
    assert metrics['kt_serve_requests_total{"status": "503"}'] == 1


def test_sigterm_drains_the_accepted_requests_and_exits_0(tiny_export, translator, tmp_path):
    export, endless = tiny_export
    flags = ["--workers", "1", "--threads", "1", "--max-batch-sentences", "1"]
    server = Server(export, *flags, "--max-wait-ms", "0", log_dir=tmp_path)
    try:
        texts = [endless] * 12 + ["ka ko"]
        answers = []
        client = threading.Thread(
            target=lambda: answers.append(
                post(server.port, {"texts": texts, "beam_size": 1, "max_decoding_length": 512})
            )
        )
        client.start()
        wait_until(lambda: server.queued() > 0, what="the request queueing")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, server.output()
        client.join(60)
        status, answer, _ = answers[0]
        assert status == 200
        expected = translator.translate(texts, beam_size=1, max_length=512)
        assert answer["translations"] == expected
        with pytest.raises(OSError):  # no longer accepting
            request(server.port, "GET", "/health", timeout=5)
    finally:
        server.stop()


def test_a_model_that_fails_to_load_exits_with_a_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.serve", str(tmp_path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "error: cannot load the model" in result.stderr
    assert f"manifest.json missing: {tmp_path}" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_server_imports_neither_tensorflow_nor_keras(tiny_export):
    code = (
        "import sys\n"
        "from keras_transformer_runtime import serve\n"
        f"args = serve.build_parser().parse_args([{tiny_export[0]!r}])\n"
        "engine = serve.Engine(args.onnx_dir, 1, 1)\n"
        "serve.create_app(engine, args)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
