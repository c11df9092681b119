"""Dense matmul peaks: what a benchmark's utilization is held to."""

from __future__ import annotations

import math
import time


def matmul_peak(library, size=None, repeats=5, dtype="float32"):
    """Best dense matmul GFLOP/s of `library` ("tensorflow", "jax", "torch") on
    size x size operands.

    On the CPU one 4096 x 4096 product is timed; on a GPU, where one product
    takes about a millisecond, ten 8192 x 8192 products are queued back to back
    and timed together, so the launch and synchronization overhead is spread.
    Operands are random normal numbers drawn on the device (zeros or constants
    can run faster than real data); the best of `repeats` timings counts,
    after one untimed run.
    """
    gpu = accelerated(library)
    size = size or (8192 if gpu else 4096)
    chain = 10 if gpu else 1
    if library == "torch":
        import torch

        device = "cuda" if gpu else "cpu"
        a, b = (torch.randn(size, size, device=device).to(getattr(torch, dtype)) for _ in "ab")

        def run():
            for _ in range(chain):
                c = a @ b
            if gpu:
                torch.cuda.synchronize()
            return c

    elif library == "tensorflow":
        import tensorflow as tf

        a, b = (tf.cast(tf.random.normal((size, size)), dtype) for _ in "ab")
        product = tf.function(lambda x, y: tf.matmul(x, y)[:1, :1], autograph=False)

        def run():
            for _ in range(chain):
                c = product(a, b)
            return c.numpy()

    elif library == "jax":
        import jax

        keys = jax.random.split(jax.random.key(0))
        a, b = (jax.random.normal(key, (size, size), dtype) for key in keys)
        product = jax.jit(lambda x, y: x @ y)

        def run():
            for _ in range(chain):
                c = product(a, b)
            return c.block_until_ready()

    else:
        raise ValueError(f"no matmul timer for library {library!r}")
    run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / (best / chain) / 1e9


def accelerated(library):
    """Whether `library` ("torch", "jax", "tensorflow") computes on a GPU here."""
    if library == "torch":
        import torch

        return torch.cuda.is_available()
    if library == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    return False


def library_peaks(peers, device, repeats=5, mixed="bfloat16"):
    """Dense matmul GFLOP/s of the backend (and of torch when it is a peer), by
    "<library>-<precision>"; on a GPU also bfloat16 (every row is given against
    it) and `mixed`, the type mixed-precision peers are held to."""
    import keras

    libraries = [keras.backend.backend()]
    if "torch" in peers:
        try:
            import torch  # noqa: F401

            libraries.append("torch")
        except ImportError:
            pass
    precisions = ["float32"] + (sorted({"bfloat16", mixed}) if device != "cpu" else [])
    return {
        f"{library}-{precision}": matmul_peak(library, repeats=repeats, dtype=precision)
        for precision in precisions
        for library in libraries
    }


def best_peaks(peaks):
    """precision -> the best of the libraries' peaks."""
    best = {}
    for key, value in peaks.items():
        precision = key.rsplit("-", 1)[1]
        best[precision] = max(best.get(precision, 0.0), value)
    return best
