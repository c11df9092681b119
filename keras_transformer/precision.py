"""Choosing the training precision: `--precision auto`.

bfloat16 halves the matmul cost only where the hardware multiplies bfloat16
natively: a CPU with AVX512_BF16 or AMX, or a GPU of compute capability 8.0 or
later. Elsewhere (an AVX2-only CPU, for one) Keras' bfloat16 kernels convert
to float32 and back and run slower than float32, so `auto` picks float32.
float16 is never picked automatically: it needs loss scaling and gains
nothing over bfloat16 on the hardware that has both.
"""

from __future__ import annotations

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = ("auto", *PRECISIONS)
# /proc/cpuinfo flags of native bfloat16 arithmetic (AVX512_BF16, AMX-BF16).
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """(major, minor) compute capability of each GPU the Keras backend sees."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        found = []
        for gpu in tf.config.list_physical_devices("GPU"):
            capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
            found.append(tuple(capability) if capability else (0, 0))
        return found
    if backend == "jax":
        import jax

        return [
            tuple(int(x) for x in str(getattr(d, "compute_capability", "0.0")).split(".")[:2])
            for d in jax.devices()
            if d.platform == "gpu"
        ]
    if backend == "torch":
        import torch

        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return []


def resolve_precision(requested: str, flags=None, gpus=None) -> tuple[str, str]:
    """The Keras dtype policy for `requested`, and why.

    Args:
        requested: one of `CHOICES`. Anything but "auto" is returned as is.
        flags: the CPU flags (default: `cpu_flags()`).
        gpus: GPU compute capabilities (default: `gpu_compute_capabilities()`).

    Returns:
        `(policy, reason)`, e.g. `("float32", "auto: CPU without avx512_bf16 or amx_bf16")`.

    Example:

    >>> resolve_precision("auto", flags={"avx2", "fma"}, gpus=[])
    ('float32', 'auto: CPU without avx512_bf16 or amx_bf16')
    >>> resolve_precision("auto", flags={"avx512f", "avx512_bf16"}, gpus=[])[0]
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
    if native:
        return "mixed_bfloat16", f"auto: CPU with {' and '.join(native)}"
    return "float32", f"auto: CPU without {' or '.join(BFLOAT16_CPU_FLAGS)}"
