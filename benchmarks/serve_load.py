"""`keras-transformer-serve` under load, beside the offline translator: `python -m benchmarks.serve_load`.

Each client of C concurrent clients (C = 1, 8, 32, 128 by default) sends
single-sentence `POST /translate` requests over one kept-alive connection,
the next as soon as the last is answered, until the sentences
(test_2016_flickr.de by default) are all sent. Measured for greedy and beam
4, on loopback:

- `batching`: the server as shipped (batching across requests);
- `no-batching`: the server with `--max-batch-sentences 1 --workers 1`, one
  sentence at a time on every core, as a server that sends each request to
  the model alone does (OpenNMT-py's REST server, say);
- `offline`: the same sentences through `OnnxTranslator.translate` at
  batch 32 in a process of its own, the ceiling.

Each row: sentences/s, latency p50/p95/p99, errors, the mean batch size
and the share of the time a batch was searching (from the server's
/metrics), the CPU seconds of the server (or offline process) and of the
load generator, sentences per CPU second, and the load average before and
after. On a machine others share, sentences/s follow the share of the
cores each process got; sentences per CPU second compare the work each
did for a sentence whatever that share. `--soak SECONDS` then runs
the batching server at `--soak-clients` for that long, sampling its RSS,
and ends with SIGTERM during the load: the server must exit 0 and every
request sent must be answered.

Each server runs in its own process; the load generator uses asyncio
streams (no HTTP library), so that its own cost per request stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from benchmarks import harness

DEFAULT_SOURCE = os.path.join(harness.SHARED_MULTI30K, "test_2016_flickr.de.gz")
STARTUP_SECONDS = 300


# --------------------------------------------------------------------------- server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path, timeout=10):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return response.read()


class ServerProcess:
    """`python -m keras_transformer_runtime.serve ONNX FLAGS` on a free port, up once /health answers."""

    def __init__(self, onnx_dir, flags, log_path):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "keras_transformer_runtime.serve", onnx_dir]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited; see {log_path}")
            try:
                get(self.port, "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server did not start; see {log_path}") from None
                time.sleep(0.2)

    def batch_stats(self):
        """`(batches, sentences, search seconds)` so far, from /metrics."""
        names = (
            "kt_serve_batch_sentences_count",
            "kt_serve_batch_sentences_sum",
            "kt_serve_batch_seconds_sum",
        )
        values = {}
        for line in get(self.port, "/metrics").decode().splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                values[name] = float(value)
        return tuple(values[name] for name in names)

    def cpu_seconds(self):
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self):
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# --------------------------------------------------------------------------- load


async def one_client(port, take, extra, records, stopping=None):
    """Sends the sentences `take()` gives, one request each, over one kept-alive connection.

    Appends `(status, seconds)` to `records` per request; status 0 is a
    request that got no answer (the connection failed or closed). With
    `stopping`, sends no new request once `stopping()` is true, and stops at
    the first request without an answer.
    """
    host = "127.0.0.1"
    reader = writer = None
    try:
        while stopping is None or not stopping():
            text = take()
            if text is None:
                return
            body = json.dumps({"texts": [text], **extra}).encode()
            head = (
                f"POST /translate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            started = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                writer.write(head + body)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionError("closed")
                status = int(status_line.split()[1])
                length, close = 0, False
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                await reader.readexactly(length)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                records.append((0, time.perf_counter() - started))
                if writer is not None:
                    writer.close()
                writer = None
                if stopping is not None:
                    return  # the server is going away (the soak's SIGTERM)
                continue
            records.append((status, time.perf_counter() - started))
            if close:
                writer.close()
                writer = None
    finally:
        if writer is not None:
            writer.close()


def run_clients(port, sentences, clients, extra):
    """Runs `clients` clients until the sentences are all sent; `[(status, seconds)]`."""
    position = [0]

    def take():
        i = position[0]
        if i >= len(sentences):
            return None
        position[0] = i + 1
        return sentences[i]

    records = []

    async def main():
        await asyncio.gather(*(one_client(port, take, extra, records) for _ in range(clients)))

    asyncio.run(main())
    return records


def percentile(values, q):
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def load_cell(server, sentences, clients, beam_size, name):
    extra = {"beam_size": beam_size}
    # A short warm-up: the first requests of each shape are slower.
    run_clients(server.port, sentences[: 2 * clients], clients, extra)
    load_before = harness.load_average()
    batches_before = server.batch_stats()
    server_cpu = server.cpu_seconds()
    own_cpu = sum(os.times()[:2])
    started = time.perf_counter()
    records = run_clients(server.port, sentences, clients, extra)
    seconds = time.perf_counter() - started
    batches_after = server.batch_stats()
    server_cpu_s = server.cpu_seconds() - server_cpu
    ok = [latency for status, latency in records if status == 200]
    batches = batches_after[0] - batches_before[0]
    row = {
        "system": name,
        "beam_size": beam_size,
        "clients": clients,
        "sentences": len(ok),
        "seconds": round(seconds, 3),
        "sentences_per_s": round(len(ok) / seconds, 2),
        "p50_ms": round(1000 * percentile(ok, 50), 1),
        "p95_ms": round(1000 * percentile(ok, 95), 1),
        "p99_ms": round(1000 * percentile(ok, 99), 1),
        "errors": len(records) - len(ok),
        "mean_batch_sentences": round((batches_after[1] - batches_before[1]) / batches, 2)
        if batches
        else None,
        # The share of the time a batch was being searched (one worker).
        "searching_fraction": round((batches_after[2] - batches_before[2]) / seconds, 3),
        "server_cpu_s": round(server_cpu_s, 2),
        "sentences_per_cpu_s": round(len(ok) / server_cpu_s, 2) if server_cpu_s else None,
        "load_generator_cpu_s": round(sum(os.times()[:2]) - own_cpu, 2),
        "load_average_before": load_before,
        "load_average_after": harness.load_average(),
    }
    print(json.dumps(row), flush=True)
    return row


def offline(onnx_dir, source, limit, beam_size, batch_size, in_order=False):
    """The offline translator in a process of its own.

    All the sentences in one call (sorted by length into batches: the
    ceiling), or with `in_order` one call per `batch_size` sentences in
    their order, as a server gets them from that many concurrent clients.
    """
    if in_order:
        run = (
            f"for i in range(0, len(sentences), {batch_size}):\n"
            f"    translator.translate(sentences[i : i + {batch_size}], beam_size={beam_size})\n"
        )
    else:
        run = f"translator.translate(sentences, beam_size={beam_size}, batch_size={batch_size})\n"
    code = (
        "import json, sys, time\n"
        "from benchmarks.harness import read_lines\n"
        "from keras_transformer_runtime import OnnxTranslator\n"
        f"sentences = read_lines({source!r}, {limit!r})\n"
        f"translator = OnnxTranslator({onnx_dir!r})\n"
        f"translator.translate(sentences[:64], beam_size={beam_size}, batch_size={batch_size})\n"
        "started, cpu = time.perf_counter(), time.process_time()\n"
        + run
        + "seconds, cpu = time.perf_counter() - started, time.process_time() - cpu\n"
        "print(json.dumps({'seconds': seconds, 'cpu': cpu, 'sentences': len(sentences)}))\n"
    )
    load_before = harness.load_average()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the offline translator failed:\n{result.stderr[-2000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    row = {
        "system": f"offline batch {batch_size}" + (", in order" if in_order else ""),
        "beam_size": beam_size,
        "clients": None,
        "sentences": measured["sentences"],
        "seconds": round(measured["seconds"], 3),
        "sentences_per_s": round(measured["sentences"] / measured["seconds"], 2),
        "cpu_s": round(measured["cpu"], 2),
        "sentences_per_cpu_s": round(measured["sentences"] / measured["cpu"], 2),
        "load_average_before": load_before,
        "load_average_after": harness.load_average(),
    }
    print(json.dumps(row), flush=True)
    return row


def soak(server, sentences, clients, seconds, beam_size):
    """Full load for `seconds`, RSS sampled; then SIGTERM during the load."""
    extra = {"beam_size": beam_size}
    samples = []
    records = []
    state = {"stop": False}

    async def main():
        deadline = time.monotonic() + seconds
        loop_records = records

        async def sampler():
            start = time.monotonic()
            while time.monotonic() < deadline:
                samples.append((round(time.monotonic() - start, 1), round(server.rss_mib(), 1)))
                await asyncio.sleep(max(1.0, seconds / 30))

        position = [0]

        def take():
            position[0] += 1
            return sentences[position[0] % len(sentences)]

        tasks = [
            asyncio.ensure_future(
                one_client(server.port, take, extra, loop_records, lambda: state["stop"])
            )
            for _ in range(clients)
        ]
        await sampler()
        # SIGTERM during the load: the server stops accepting, answers what
        # it accepted, and exits; the clients stop at their first refusal.
        answered_before = len(loop_records)
        server.process.send_signal(signal.SIGTERM)
        term_sent = time.monotonic()
        state["stop"] = True  # each client stops after its request in flight
        await asyncio.gather(*tasks)
        return answered_before, term_sent

    started = time.perf_counter()
    answered_before, term_sent = asyncio.run(main())
    exit_status = server.process.wait(120)
    exited_after = time.monotonic() - term_sent
    during = records[:answered_before]
    after = records[answered_before:]
    statuses = {}
    for status, _ in during:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    rss = [mib for _, mib in samples]
    row = {
        "clients": clients,
        "beam_size": beam_size,
        "seconds": round(time.perf_counter() - started, 1),
        "requests": len(during),
        "statuses": statuses,
        "rss_mib_samples": samples,
        "rss_mib_first_last_max": [rss[0], rss[-1], max(rss)] if rss else None,
        "sigterm": {
            "exit_status": exit_status,
            "exited_after_s": round(exited_after, 2),
            "answered_after_sigterm": sum(1 for s, _ in after if s == 200),
            "unanswered_after_sigterm": sum(1 for s, _ in after if s == 0),
        },
        "load_average_after": harness.load_average(),
    }
    print(json.dumps(row), flush=True)
    return row


# --------------------------------------------------------------------------- main


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--onnx", required=True, help="an export folder (keras-transformer export)")
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="sentences, one a line (.gz ok)")
    parser.add_argument("--limit", type=int, help="the first N sentences only")
    parser.add_argument("--clients", default="1,8,32,128", help="concurrent clients to measure")
    parser.add_argument("--beams", default="1,4", help="beam sizes to measure (1: greedy)")
    parser.add_argument(
        "--systems",
        default="offline,batching,no-batching",
        help="which of offline, batching, no-batching to measure",
    )
    parser.add_argument(
        "--server-flags",
        default="",
        help="extra flags of the servers, one string (the no-batching one then turns batching off)",
    )
    parser.add_argument("--soak", type=float, default=0, help="soak seconds (0: none)")
    parser.add_argument("--soak-clients", type=int, default=32)
    parser.add_argument("--out", required=True, help="the results JSON file to write")
    return parser


NO_BATCHING_FLAGS = ["--max-batch-sentences", "1", "--workers", "1"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    sentences = harness.read_lines(args.source, args.limit)
    clients = [int(c) for c in args.clients.split(",") if c]
    beams = [int(b) for b in args.beams.split(",") if b]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - {"offline", "batching", "no-batching"}
    if unknown:
        raise SystemExit(f"error: unknown systems {sorted(unknown)}")
    rows = []
    log_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(log_dir, exist_ok=True)
    if "offline" in systems:
        for beam_size in beams:
            for in_order in (False, True):
                rows.append(offline(args.onnx, args.source, args.limit, beam_size, 32, in_order))
    servers = {
        "batching": args.server_flags.split(),
        # The same server with batching off: the flags that are not about batching apply.
        "no-batching": args.server_flags.split() + NO_BATCHING_FLAGS,
    }
    soak_row = None
    for name, flags in servers.items():
        if name not in systems:
            continue
        log = os.path.join(log_dir, f".serve_load-{name}.log")
        server = ServerProcess(args.onnx, flags, log)
        try:
            for beam_size in beams:
                for count in clients:
                    rows.append(load_cell(server, sentences, count, beam_size, name))
            if name == "batching" and args.soak > 0:
                soak_row = soak(server, sentences, args.soak_clients, args.soak, beams[0])
        finally:
            server.stop()
        os.remove(log)

    def find(system, beam_size, count):
        for row in rows:
            if row["system"] == system and row["beam_size"] == beam_size:
                if count is None or row["clients"] == count:
                    return row
        return None

    ratios = {}
    for beam_size in beams:
        for count in clients:
            served = find("batching", beam_size, count)
            if served is None:
                continue
            ceiling = find("offline batch 32", beam_size, None)
            in_order = find("offline batch 32, in order", beam_size, None)
            alone = find("no-batching", beam_size, count)
            ratios[f"beam {beam_size}, {count} clients"] = {
                # Sentences per CPU second against the offline translator's: the
                # server's overhead, whatever share of a busy machine each got.
                "cpu_efficiency_of_offline_batch_32": _ratio(
                    served, ceiling, "sentences_per_cpu_s"
                ),
                "of_offline_batch_32_in_order": _ratio(served, in_order),
                "of_offline_batch_32": _ratio(served, ceiling),
                "of_no_batching": _ratio(served, alone),
            }
    return harness.write_report("serve_load", args, rows=rows, ratios=ratios, soak=soak_row)


def _ratio(row, other, key="sentences_per_s"):
    """`row[key] / other[key]`, or None where either is missing."""
    return round(row[key] / other[key], 3) if row and other and row[key] and other[key] else None


if __name__ == "__main__":
    main()
