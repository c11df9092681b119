import pytest

from keras_transformer.ops import (
    HAND_WRITTEN_PARTS,
    hand_written_gradients,
    set_hand_written_gradients,
)

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
