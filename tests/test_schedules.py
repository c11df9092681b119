"""The paper's learning-rate schedule and its Adam optimizer (keras_transformer.schedules)."""

import keras
import numpy as np
import pytest

from keras_transformer import LabelSmoothedCrossEntropy, TransformerSchedule, transformer_optimizer
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def formula(step, d, warmup):
    return d**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize("step", [1, 4000, 40000, 123, 9999])
def test_schedule_matches_paper_formula(step):
    schedule = TransformerSchedule(hidden_dim=512, warmup_steps=4000)
    assert float(to_numpy(schedule(step))) == pytest.approx(formula(step, 512, 4000), rel=1e-6)


def test_schedule_peaks_at_warmup_and_scales():
    schedule = TransformerSchedule(hidden_dim=256, warmup_steps=100, scale=2.0)
    values = [float(to_numpy(schedule(s))) for s in range(1, 1001)]
    assert int(np.argmax(values)) + 1 == 100
    assert values[99] == pytest.approx(2.0 * formula(100, 256, 100), rel=1e-6)
    # Keras' iteration counter starts at 0: treated as step 1, never a zero rate.
    assert float(to_numpy(schedule(0))) == pytest.approx(values[0], rel=1e-6)


def test_schedule_serializes():
    schedule = TransformerSchedule(hidden_dim=128, warmup_steps=50, scale=0.5)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert isinstance(restored, TransformerSchedule)
    assert restored.get_config() == schedule.get_config()
    assert float(to_numpy(restored(70))) == pytest.approx(float(to_numpy(schedule(70))))


@pytest.mark.parametrize(
    "kwargs,message",
    [(dict(hidden_dim=0), "hidden_dim"), (dict(hidden_dim=8, warmup_steps=0), "warmup_steps")],
)
def test_schedule_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerSchedule(**kwargs)


def test_cooldown_falls_linearly_to_zero_over_the_last_updates():
    plain = TransformerSchedule(hidden_dim=64, warmup_steps=10)
    cooled = TransformerSchedule(hidden_dim=64, warmup_steps=10, total_steps=100, cooldown_steps=20)

    def rate(schedule, iteration):
        return float(to_numpy(schedule(iteration)))

    # Keras' counter runs 0..99 for a 100-update run: 80..99 are the cool-down.
    for iteration in (0, 10, 50, 80):
        assert rate(cooled, iteration) == pytest.approx(rate(plain, iteration), rel=1e-6)
    for iteration in (81, 90, 99):
        expected = rate(plain, iteration) * (100 - iteration) / 20
        assert rate(cooled, iteration) == pytest.approx(expected, rel=1e-5)
    assert rate(cooled, 100) == 0.0 and rate(cooled, 150) == 0.0  # past the run: no updates
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cooled))
    assert restored.get_config() == cooled.get_config()
    assert rate(restored, 90) == pytest.approx(rate(cooled, 90))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(cooldown_steps=10), "cooldown_steps needs total_steps"),
        (dict(cooldown_steps=11, total_steps=10), r"cooldown_steps \(11\) must be at most"),
        (dict(cooldown_steps=0, total_steps=10), "cooldown_steps"),
    ],
)
def test_cooldown_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerSchedule(hidden_dim=8, warmup_steps=4, **kwargs)


def test_optimizer_is_the_papers_adam():
    optimizer = transformer_optimizer(512, warmup_steps=4000)
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.9, 0.98, 1e-9)
    assert isinstance(optimizer._learning_rate, TransformerSchedule)


def test_schedule_counts_updates_under_accumulation():
    plain = TransformerSchedule(hidden_dim=64, warmup_steps=10)
    accumulated = TransformerSchedule(hidden_dim=64, warmup_steps=10, accumulation_steps=4)
    # Keras hands the schedule its micro-batch counter: micro-batch i belongs to update i // 4.
    for micro_batch in (0, 3, 4, 39, 40, 41, 400):
        assert float(to_numpy(accumulated(micro_batch))) == pytest.approx(
            float(to_numpy(plain(micro_batch // 4))), rel=1e-6
        )
    assert accumulated.peak() == pytest.approx(float(to_numpy(plain(10))), rel=1e-6)


def _fit_tiny(accumulation_steps, batch_size, updates, data):
    from keras_transformer import TransformerConfig, build_transformer

    keras.utils.set_random_seed(3)
    model = build_transformer(TransformerConfig.from_preset("tiny", vocabulary_size=40))
    # Adam's epsilon 1e-5 instead of the paper's 1e-9: with 1e-9 a weight whose
    # gradient is float32 rounding noise (about 1e-9) moves by +-lr either way,
    # so summing the same gradients in another order would flip it.
    optimizer = transformer_optimizer(
        64, warmup_steps=4, accumulation_steps=accumulation_steps, epsilon=1e-5
    )
    # Under TensorFlow, eager: the same optimizer arithmetic without tracing a
    # training function for each of the three models (most of the test's
    # time there). Under JAX, compiling is the faster way.
    model.compile(
        optimizer=optimizer,
        loss=LabelSmoothedCrossEntropy(0.1),
        run_eagerly=keras.backend.backend() == "tensorflow",
    )
    inputs, labels = data
    model.fit(inputs, labels, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    assert int(to_numpy(model.optimizer.iterations)) == updates
    return [to_numpy(w) for w in model.trainable_weights]


def test_accumulated_half_batches_give_the_full_batch_update():
    """Two updates from 4 half-batches (accumulation 2) equal two from 2 full batches.

    The loss is the mean over real tokens; every sentence here has 7 real
    tokens, so the mean of two half-batch means is the full-batch mean. The
    tiny preset has no dropout. Tolerance: 1e-5 absolute, against updates of
    about 1e-2 and a largest weight change of 0.1 when the same half-batches
    are applied one update each.
    """
    rng = np.random.default_rng(0)
    labels = rng.integers(4, 40, size=(8, 7)).astype("int32")
    inputs = {
        "source_ids": rng.integers(4, 40, size=(8, 9)).astype("int32"),
        "target_ids": np.concatenate([np.full((8, 1), 2, "int32"), labels[:, :-1]], axis=1),
    }
    full = _fit_tiny(1, 4, updates=2, data=(inputs, labels))
    accumulated = _fit_tiny(2, 2, updates=2, data=(inputs, labels))
    separate = _fit_tiny(1, 2, updates=4, data=(inputs, labels))  # no accumulation
    for a, b in zip(full, accumulated, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    largest = max(float(np.abs(a - b).max()) for a, b in zip(full, separate, strict=True))
    assert largest > 1e-2


def test_a_constant_rate_follows_a_linear_warm_up_and_the_cool_down():
    schedule = TransformerSchedule(
        hidden_dim=512, warmup_steps=10, constant=5e-5, total_steps=100, cooldown_steps=20
    )
    rates = [float(to_numpy(schedule(i))) for i in (0, 4, 9, 10, 50, 80, 90, 99)]
    assert rates[:3] == pytest.approx([5e-6, 2e-5, 4.5e-5])  # iteration 0 counts as step 1
    assert rates[3:6] == pytest.approx([5e-5] * 3)
    assert rates[6:] == pytest.approx([5e-5 * 10 / 20, 5e-5 / 20])
    assert schedule.peak() == 5e-5
    restored = TransformerSchedule.from_config(schedule.get_config())
    assert float(to_numpy(restored(50))) == pytest.approx(5e-5)
    with pytest.raises(ValueError, match="constant must be a positive number"):
        TransformerSchedule(hidden_dim=8, constant=0)
