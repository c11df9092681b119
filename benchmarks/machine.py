"""A description of the machine a benchmark ran on, stored with its results."""

from __future__ import annotations

import os
import platform


def describe_machine() -> dict:
    from keras_transformer.precision import cpu_name

    cpu = cpu_name() or platform.processor() or ""
    memory_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
            memory_gib = round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    import keras

    from keras_transformer.startup import onednn_enabled

    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "tensorflow_onednn": onednn_enabled(),
        "platform": platform.platform(),
    }


def write_report(module, args, **fields):
    """Writes a benchmark's JSON report to `args.out` and returns it: the command
    that made it (`python -m benchmarks.<module> ARGV`), its settings, `fields` in
    the order given, and the machine. `args` holds the parsed options and `argv`."""
    import json
    import shlex

    from keras_transformer.io_utils import atomic_write_text

    report = {
        "command": f"python -m benchmarks.{module} " + shlex.join(args.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
        **fields,
        "machine": describe_machine(),
    }
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")  # key order kept
    return report


# The shared Multi30k mirror, found beside the repository (`../shared`), never
# at a path of one machine; every benchmark that reads it also takes the path
# as an argument.
SHARED_MULTI30K = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "multi30k"
)
