"""Choosing the training precision: `--precision auto`.

bfloat16 halves the matmul cost only where the hardware multiplies bfloat16
natively: a CPU with AVX512_BF16 or AMX, or a GPU of compute capability 8.0 or
later. Elsewhere (an AVX2-only CPU, for one) Keras' bfloat16 kernels convert
to float32 and back and run slower than float32, so `auto` picks float32.
Under JAX a CPU gets float32 too: XLA's CPU code runs the train step slower
in bfloat16 than in float32, even where the CPU has AVX512_BF16.
float16 is never picked automatically: it needs loss scaling and gains
nothing over bfloat16 on the hardware that has both.
"""

from __future__ import annotations

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = ("auto", *PRECISIONS)
# /proc/cpuinfo flags of native bfloat16 arithmetic (AVX512_BF16, AMX-BF16).
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def _first_processor(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The fields of the first processor in `path` (/proc/cpuinfo's format), as
    `{name: value}`; empty where there is no such file."""
    fields = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    return set(_first_processor(path).get("flags", "").split())


def cpu_name(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family and model numbers, as in
    "AMD EPYC (family 23, model 1)": vendors reuse one name across
    generations, the numbers tell them apart. Empty where Linux does not say."""
    fields = _first_processor(path)
    name = fields.get("model name", "")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name.strip()


def visible_gpus() -> list[tuple[str, tuple[int, int]]]:
    """(name, (major, minor) compute capability) of each GPU the Keras backend sees."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        found = []
        for gpu in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(gpu)
            capability = details.get("compute_capability")
            found.append(
                (details.get("device_name", gpu.name), tuple(capability) if capability else (0, 0))
            )
        return found
    if backend == "jax":
        import jax

        return [
            (
                d.device_kind,
                tuple(int(x) for x in str(getattr(d, "compute_capability", "0.0")).split(".")[:2]),
            )
            for d in jax.devices()
            if d.platform == "gpu"
        ]
    if backend == "torch":
        import torch

        return [
            (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        ]
    return []


def gpu_compute_capabilities(found_gpus=None) -> list[tuple[int, int]]:
    """(major, minor) compute capability of each of `found_gpus` (default:
    `visible_gpus()`, the GPUs the Keras backend sees)."""
    found_gpus = visible_gpus() if found_gpus is None else found_gpus
    return [capability for _, capability in found_gpus]


def training_device(found_gpus=None, cpu: str | None = None) -> str:
    """What trains: the GPUs the backend sees ("2 x NVIDIA H100 80GB HBM3"), else the CPU.

    Example:

    >>> training_device([], cpu="AMD EPYC (family 23, model 1)")
    'AMD EPYC (family 23, model 1)'
    >>> training_device([("NVIDIA H100", (9, 0))] * 2)
    '2 x NVIDIA H100'
    """
    found_gpus = visible_gpus() if found_gpus is None else list(found_gpus)
    if found_gpus:
        names = sorted({name for name, _ in found_gpus})
        count = len(found_gpus)
        return (f"{count} x " if count > 1 else "") + " + ".join(names)
    return (cpu_name() if cpu is None else cpu) or "unknown CPU"


def check_backend_precision(requested: str, backend=None, gpus=None) -> None:
    """Raises ValueError for a precision the backend cannot train in here: `mixed_float16`
    under JAX without a GPU (XLA's CPU backend has no float16 matrix product). `backend`
    and `gpus` (`visible_gpus()`) default to what this process has."""
    if requested != "mixed_float16":
        return
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend == "jax" and not (visible_gpus() if gpus is None else gpus):
        raise ValueError(
            "precision mixed_float16 under JAX needs a GPU: XLA's CPU backend has no float16 "
            "matrix product. Use mixed_bfloat16, float32 or auto."
        )


def resolve_precision(requested: str, flags=None, gpus=None, backend=None) -> tuple[str, str]:
    """The Keras dtype policy for `requested`, and why.

    Args:
        requested: one of `CHOICES`. Anything but "auto" is returned as is.
        flags: the CPU flags (default: `cpu_flags()`).
        gpus: GPU compute capabilities (default: `gpu_compute_capabilities()`).
        backend: the Keras backend (default: the one in use). XLA's CPU code is
            slower in bfloat16 than in float32 (docs/distributed.md), so on a CPU
            JAX gets float32 whatever the CPU computes.

    Returns:
        `(policy, reason)`, e.g. `("float32", "auto: CPU without avx512_bf16 or amx_bf16")`.

    Example:

    >>> resolve_precision("auto", flags={"avx2", "fma"}, gpus=[])
    ('float32', 'auto: CPU without avx512_bf16 or amx_bf16')
    >>> resolve_precision("auto", flags={"avx512f", "avx512_bf16"}, gpus=[], backend="tensorflow")[0]
    'mixed_bfloat16'
    """
    if requested not in CHOICES:
        raise ValueError(
            f"precision must be one of {', '.join(CHOICES)}. Received: precision={requested!r}"
        )
    if requested != "auto":
        return requested, "requested"
    gpus = gpu_compute_capabilities() if gpus is None else list(gpus)
    if gpus:
        slowest = min(gpus)
        if slowest >= (8, 0):
            return "mixed_bfloat16", f"auto: GPU of compute capability {slowest[0]}.{slowest[1]}"
        return "float32", (
            f"auto: GPU of compute capability {slowest[0]}.{slowest[1]} (bfloat16 needs 8.0)"
        )
    flags = cpu_flags() if flags is None else set(flags)
    native = [flag for flag in BFLOAT16_CPU_FLAGS if flag in flags]
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if native and backend == "jax":
        return "float32", "auto: JAX on a CPU, where XLA computes float32 faster than bfloat16"
    if native:
        return "mixed_bfloat16", f"auto: CPU with {' and '.join(native)}"
    return "float32", f"auto: CPU without {' or '.join(BFLOAT16_CPU_FLAGS)}"
