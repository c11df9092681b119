"""What every benchmark here shares: data, the systems' contract, timing, tables, reports.

A benchmark answers one question with one table. Its systems translate under
one contract, as the systems of CTranslate2's `tools/benchmark` do: a
translator with `translate(lines, beam_size=, batch_size=, parallel_batches=)`
returning one text per line, a `tokenizer` whose `encode_target` counts the
pieces of an output, and `close()` where it holds a process
(`OnnxTranslator` and `ctranslate2_peer.CTranslate2Translator` both qualify).
The systems run on the same sentences, their repetitions interleaved
(`interleaved`), and the run writes one JSON report (`write_report`): the
command that made it, its settings, its rows and the machine. The file behind
a table is the latest run of its command; older runs are in git history.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import shlex
import statistics
import subprocess
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# The shared Multi30k mirror, found beside the repository (`../shared`), never
# at a path of one machine; every benchmark that reads it also takes the path
# as an argument.
SHARED_MULTI30K = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data", "multi30k"))


def read_lines(path, limit=None):
    """The lines of a UTF-8 file, gzipped or not (undecodable bytes replaced, as
    the package's readers do), the first `limit` where given. Imports no
    framework, so that a load generator can use it."""
    from keras_transformer_runtime.text import decode_lines

    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        lines, _ = decode_lines(f.read())
    return lines[:limit]


def multi30k(data, split, src, tgt, limit=None):
    """`(sources, references)` of one Multi30k split in the folder `data`."""
    return tuple(read_lines(os.path.join(data, f"{split}.{lang}.gz"), limit) for lang in (src, tgt))


def timed(fn, *args, **kwargs):
    """`(fn(*args, **kwargs), seconds)`."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def interleaved(runs, repeats):
    """Runs each callable of `runs` (name -> fn()) once per round, `repeats` rounds, so
    that a machine whose speed drifts slows every system alike. Returns name ->
    `(seconds of each round, the last round's output)`."""
    seconds = {name: [] for name in runs}
    outputs = {}
    for _ in range(repeats):
        for name, run in runs.items():
            outputs[name], took = timed(run)
            seconds[name].append(took)
    return {name: (seconds[name], outputs[name]) for name in runs}


def speed(texts, seconds, tokenizer):
    """Sentences/s and target tokens/s of one system's outputs `texts` over the
    median of `seconds` (target tokens as CTranslate2's benchmark counts them: the
    pieces of each output, without BOS and EOS)."""
    median = statistics.median(seconds)
    tokens = sum(len(tokenizer.encode_target(text)) for text in texts)
    return {
        "sentences_per_second": len(texts) / median,
        "target_tokens_per_second": tokens / median,
        "target_tokens": tokens,
        "seconds": list(seconds),
    }


def close(systems):
    """Closes every system of `systems` (a dict) that holds a process."""
    for system in systems.values():
        if hasattr(system, "close"):
            system.close()


def markdown(header, rows):
    """A markdown table of `header` (column names) and `rows` (lists of cells)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def load_average():
    """The 1, 5 and 15 minute load averages, rounded (None where the system has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def read_reports(paths):
    reports = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    return reports


def describe_machine() -> dict:
    import keras

    from keras_transformer.precision import cpu_name
    from keras_transformer.startup import onednn_enabled

    memory_gib = None
    try:
        with open("/proc/meminfo") as f:
            memory_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu_name() or platform.processor() or "",
        "logical_cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "tensorflow_onednn": onednn_enabled(),
        "platform": platform.platform(),
    }


def write_report(module, args, **fields):
    """Writes a benchmark's JSON report to `args.out` (atomically) and returns it: the
    command that made it (`python -m benchmarks.<module> ARGV`), its settings,
    `fields` in the order given, and the machine. `args` holds the parsed
    options and `argv`."""
    report = {
        "command": f"python -m benchmarks.{module} " + shlex.join(args.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
        **fields,
        "machine": describe_machine(),
    }
    write_json(args.out, report)
    return report


def write_json(path, payload):
    """Writes `path` atomically (a temporary file, then a rename), keys in their order,
    without importing the package: a parent process that leaves the machine to
    its children's frameworks uses it too."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def tree_rss(pid: int) -> tuple[int, int]:
    """Proportional resident bytes (PSS: shared pages divided among their sharers) of
    `pid` and its descendants, forked workers' shared pages counted once; and the
    anonymous part of it (the heap and arrays, without the shared libraries and the
    page cache of memory-mapped files, whose PSS depends on what else runs)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, anonymous, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                    elif line.startswith("Pss_Anon:"):
                        anonymous += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total, anonymous


def run_measured(command, env=None) -> dict:
    """Runs `command`; returns its wall time, output, and peak resident memory (its tree)."""
    started = time.time()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    samples = []  # (time, pss, anonymous pss)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.time(), *tree_rss(process.pid)))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = process.communicate()[0]
    stop.set()
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return {"started": started, "seconds": time.time() - started, "output": output,
            "samples": samples}  # fmt: skip


def marks(result):
    """The times the child printed as `NAME SECONDS` lines (`FIRST_UPDATE`, `LAST_UPDATE`)."""
    marks = {}
    for line in result["output"].splitlines():
        if line.startswith(("FIRST_UPDATE", "LAST_UPDATE")):
            name, value = line.split()
            marks[name] = float(value)
    return marks


def gib(n):
    return round(n / 2**30, 3)


def peaks(samples) -> dict:
    """Peak PSS and peak anonymous PSS of `run_measured`'s samples, GiB."""
    return {
        "peak_rss_gib": gib(max(s[1] for s in samples)),
        "peak_anon_gib": gib(max(s[2] for s in samples)),
    }
