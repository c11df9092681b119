"""Dropout with a cheaper random mask on TensorFlow and JAX."""

from __future__ import annotations

import keras

from keras_transformer.ops.dropout import LEVELS, rate_levels, sixteen_bit_dropout


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` that, on TensorFlow and JAX, draws one 32-bit word per two
    elements.

    In training, on the TensorFlow and JAX backends, the mask comes from
    `keras_transformer.ops.dropout.sixteen_bit_dropout`: the applied rate is
    `quantized_rate(rate)` (within 2**-17 of `rate`), and the masks are not
    those that Keras would draw from the same seed. Other backends, a
    `noise_shape`, and rates that round to 0 or 1 take Keras' own path.
    Inference (`training=False`) returns the input unchanged, as Keras does.

    Example:

    >>> layer = Dropout(0.1, seed=7)
    >>> y = layer(np.ones((4, 512), "float32"), training=True)  # ~10% zeros, rest 1/(1-0.1)
    """

    def call(self, inputs, training=False):
        levels = rate_levels(self.rate)
        if (
            not training
            or keras.backend.backend() not in ("tensorflow", "jax")
            or self.noise_shape is not None
            or not 0 < levels < LEVELS
        ):
            return super().call(inputs, training=training)
        return sixteen_bit_dropout(inputs, levels, self.seed_generator.next())
