"""The shared layer test: every layer test calls `run_layer_test`."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16", "bfloat16")


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))


def value_and_gradients(layer, x, upstream):
    """`layer(x)` and the gradients of `sum(layer(x) * upstream)` wrt `x` and the trainable weights.

    The weights' gradients come in `layer.trainable_weights` order.
    """
    if keras.backend.backend() == "jax":
        import jax

        def objective(x, *weights):
            out, _ = layer.stateless_call(list(weights), [], x)
            return ops.sum(out * upstream)

        values = (ops.convert_to_tensor(x), *(w.value for w in layer.trainable_weights))
        grads = jax.grad(objective, argnums=tuple(range(len(values))))(*values)
        return to_numpy(layer(x)), [np.asarray(g) for g in grads]
    import tensorflow as tf

    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x)
        objective = tf.reduce_sum(out * upstream)
    grads = tape.gradient(objective, [x, *(w.value for w in layer.trainable_weights)])
    return to_numpy(out), [g.numpy() for g in grads]


def _split(call_args):
    """Separates array arguments (made into inputs) from plain ones (flags)."""
    arrays = {k: v for k, v in call_args.items() if isinstance(v, np.ndarray)}
    flags = {k: v for k, v in call_args.items() if not isinstance(v, np.ndarray)}
    return arrays, flags


def run_layer_test(layer_cls, init_kwargs, call_args, expected_output_shape, rtol=1e-6):
    """Config round-trip, eager and symbolic calls, one `fit` step, precision pass.

    Args:
        layer_cls: the layer class under test.
        init_kwargs: constructor arguments.
        call_args: dict of call arguments by name; numpy arrays become model
            inputs in the symbolic call, other values are passed as they are.
        expected_output_shape: shape of the (single) output.
    """
    arrays, flags = _split(call_args)

    # Config round-trip, through the registered name as `load_model` would.
    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    assert layer_cls.from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"].startswith("keras_transformer>")
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is layer_cls and restored.get_config() == config

    # Eager call; the restored layer with the same weights computes the same thing.
    output = layer(**call_args)
    assert tuple(output.shape) == tuple(expected_output_shape)
    assert np.isfinite(to_numpy(output)).all()
    restored(**call_args)
    restored.set_weights(layer.get_weights())
    np.testing.assert_allclose(
        to_numpy(restored(**call_args)), to_numpy(output), rtol=rtol, atol=1e-6
    )

    # Symbolic call inside a functional model; one fit step changes the weights.
    inputs = {
        name: keras.Input(shape=value.shape[1:], dtype=str(value.dtype), name=name)
        for name, value in arrays.items()
    }
    symbolic_layer = layer_cls(**init_kwargs)
    symbolic_output = symbolic_layer(**inputs, **flags)
    assert tuple(symbolic_output.shape[1:]) == tuple(expected_output_shape[1:])
    model = keras.Model(inputs, symbolic_output)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)  # one trace of the step, not two
    before = [to_numpy(w).copy() for w in model.trainable_weights]
    assert before, "the layer has no trainable weights"
    target = np.random.default_rng(0).normal(size=expected_output_shape).astype("float32")
    history = model.fit(arrays, target, batch_size=len(target), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    after = [to_numpy(w) for w in model.trainable_weights]
    assert any(not np.allclose(b, a) for b, a in zip(before, after, strict=True))

    # Precision: outputs in the compute dtype, weights in the variable dtype.
    for policy_name in PRECISION_POLICIES:
        policy = keras.dtype_policies.get(policy_name)
        precise = layer_cls(**init_kwargs, dtype=policy)
        result = precise(**call_args)
        assert keras.backend.standardize_dtype(result.dtype) == policy.compute_dtype, policy_name
        assert np.isfinite(to_numpy(result)).all(), policy_name
        for weight in precise.weights:
            assert keras.backend.standardize_dtype(weight.dtype) == policy.variable_dtype, (
                policy_name,
                weight.path,
            )
    return layer, output
