import keras
import numpy as np
import pytest

from keras_transformer import LabelSmoothedCrossEntropy
from keras_transformer.ops import (
    HAND_WRITTEN_PARTS,
    hand_written_gradients,
    set_hand_written_gradients,
)
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


@pytest.fixture(autouse=True)
def _automatic_parts():
    yield
    set_hand_written_gradients(None)


def test_switch_forces_parts_and_goes_back():
    automatic = {part: hand_written_gradients(part) for part in HAND_WRITTEN_PARTS}
    set_hand_written_gradients(["layer_norm"])
    assert [p for p in HAND_WRITTEN_PARTS if hand_written_gradients(p)] == ["layer_norm"]
    set_hand_written_gradients(())
    assert not any(hand_written_gradients(p) for p in HAND_WRITTEN_PARTS)
    set_hand_written_gradients(None)
    assert {part: hand_written_gradients(part) for part in HAND_WRITTEN_PARTS} == automatic


def test_switch_refuses_unknown_parts():
    with pytest.raises(ValueError, match=r"parts must be among .* Received: \['attention'\]"):
        set_hand_written_gradients(["loss", "attention"])


def test_loss_gradient_is_the_same_through_the_switch():
    """The loss's hand-written and automatic gradients agree, chosen through the public switch."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 12, size=(2, 5))
    logits = rng.normal(size=(2, 5, 12)).astype("float32")
    loss = LabelSmoothedCrossEntropy(0.1)

    def gradient():
        if keras.backend.backend() == "jax":
            import jax

            return np.asarray(jax.grad(lambda z: loss(labels, z))(logits))
        import tensorflow as tf

        z = tf.constant(logits)
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = loss(labels, z)
        return to_numpy(tape.gradient(value, z))

    set_hand_written_gradients(["loss"])
    hand_written = gradient()
    set_hand_written_gradients(())
    automatic = gradient()
    assert np.abs(hand_written).max() > 0
    np.testing.assert_allclose(hand_written, automatic, rtol=1e-5, atol=1e-7)
