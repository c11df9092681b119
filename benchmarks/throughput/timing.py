"""Dense matmul timers: the peak a benchmark's utilization is held to, and single products."""

from __future__ import annotations

import math
import time


def matmul_peak(backend, size=None, repeats=5, dtype="float32"):
    """Best dense matmul GFLOP/s of `backend` on size x size operands.

    On the CPU one 4096 x 4096 product is timed; on a GPU, where one product
    takes about a millisecond, ten 8192 x 8192 products are queued back to back
    and timed together, so the launch and synchronization overhead is spread.
    """
    gpu = accelerated(backend)
    size = size or (8192 if gpu else 4096)
    seconds = time_product(
        backend, (size, size), (size, size), dtype=dtype, repeats=repeats, chain=10 if gpu else 1
    )
    return 2.0 * size**3 / seconds / 1e9


def time_product(
    library,
    a_shape,
    b_shape,
    transpose_a=False,
    transpose_b=False,
    dtype="float32",
    repeats=5,
    chain=1,
):
    """Best seconds of one product `a @ b` by `library` ("tensorflow", "jax", "torch").

    `a_shape` and `b_shape` are the stored shapes (leading batch dimensions
    allowed); `transpose_a`/`transpose_b` transpose the last two axes in the
    product, as the backward passes do. Operands are random normal numbers
    drawn on the device (zeros or constants can run faster than real data).
    Each timing queues `chain` products and waits for the last; the best of
    `repeats` timings, divided by `chain`, is returned, after one untimed run.
    """
    gpu = accelerated(library)
    if library == "torch":
        import torch

        device = "cuda" if gpu else "cpu"
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(a_shape, device=device).to(torch_dtype)
        b = torch.randn(b_shape, device=device).to(torch_dtype)
        a = a.mT if transpose_a else a  # views: the product reads the stored layout
        b = b.mT if transpose_b else b

        def run():
            for _ in range(chain):
                c = a @ b
            if gpu:
                torch.cuda.synchronize()
            return c

    elif library == "tensorflow":
        import tensorflow as tf

        a = tf.cast(tf.random.normal(a_shape), dtype)
        b = tf.cast(tf.random.normal(b_shape), dtype)
        product = tf.function(
            lambda x, y: tf.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b)[
                ..., :1, :1
            ],
            autograph=False,
        )

        def run():
            for _ in range(chain):
                c = product(a, b)
            return c.numpy()

    elif library == "jax":
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.key(0))
        a = jax.random.normal(keys[0], a_shape, dtype)
        b = jax.random.normal(keys[1], b_shape, dtype)

        @jax.jit
        def product(x, y):
            x = jnp.swapaxes(x, -1, -2) if transpose_a else x
            y = jnp.swapaxes(y, -1, -2) if transpose_b else y
            return x @ y

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
    return best / chain


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
