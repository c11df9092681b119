"""Dropout masks drawn 16 bits per element, on the TensorFlow and JAX backends."""

from __future__ import annotations

# Drop decisions are made on 16-bit random integers: two per 32-bit draw.
LEVELS = 2**16


def quantized_rate(rate):
    """The drop probability the 16-bit path applies: `rate` rounded to a multiple of 2**-16.

    0.1 becomes 6554 / 65536 = 0.10000610. Kept values are scaled by
    `1 / (1 - quantized_rate)`, so the expected output still equals the input.

    Example:

    >>> quantized_rate(0.1)
    0.100006103515625
    """
    return rate_levels(rate) / LEVELS


def rate_levels(rate):
    """`rate` in units of 2**-16: the number of 16-bit values that mean "drop"."""
    return round(rate * LEVELS)


def sixteen_bit_dropout(x, levels, seed):
    """Dropout of `x` that draws one 32-bit word per two elements (TensorFlow or JAX).

    Keras' dropout draws one float32 uniform per element, and on a CPU its
    random generator is most of the cost of the layer (docs/performance.md,
    "Findings of retired experiments", and "JAX on a CPU"). Here each 32-bit
    word is split into two 16-bit integers, and an element is dropped when its
    integer falls below `levels` (from `rate_levels`) of the 2**16 values.

    Args:
        x: the tensor to drop elements of.
        levels: int in (0, 2**16): the drop probability in units of 2**-16.
        seed: a stateless seed, shape `(2,)`.
    """
    import keras

    if keras.backend.backend() == "jax":
        return _sixteen_bit_dropout_jax(x, levels, seed)
    import tensorflow as tf

    if seed.dtype != tf.int32:  # as Keras' TensorFlow backend casts its seeds
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    size = tf.size(x, out_type=tf.int64)  # int32 would overflow past 2**31 elements
    words = tf.random.stateless_uniform(
        [(size + 1) // 2], seed, dtype=tf.int32, minval=None, maxval=None
    )
    # Uniform over [-2**15, 2**15): below -2**15 + levels with probability levels / 2**16.
    halves = tf.reshape(tf.bitcast(words, tf.int16), [-1])[:size]
    keep = tf.reshape(halves, tf.shape(x)) >= tf.constant(levels - LEVELS // 2, tf.int16)
    scale = tf.constant(1.0 / (1.0 - levels / LEVELS), x.dtype)
    return tf.where(keep, x * scale, tf.zeros((), x.dtype))


def _sixteen_bit_dropout_jax(x, levels, seed):
    """`sixteen_bit_dropout` under JAX: the words from XLA's own ThreeFry generator
    (`lax.rng_bit_generator`, the seed as its key, counter 0), which XLA on a CPU
    compiles to half the program of `jax.random`'s and runs in a fifth of the time
    of Keras' per-element uniforms."""
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    key = jnp.concatenate([jnp.reshape(seed, (-1,)).astype(jnp.uint32), jnp.zeros(2, jnp.uint32)])
    size = x.size
    _, words = jax.lax.rng_bit_generator(
        key, ((size + 1) // 2,), dtype=jnp.uint32, algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY
    )
    halves = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:size]
    keep = jnp.reshape(halves, x.shape) >= jnp.uint16(levels)
    scale = jnp.asarray(1.0 / (1.0 - levels / LEVELS), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))
