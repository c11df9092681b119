"""The model of a run built and compiled for training (keras_transformer.train.compile)."""

import keras
import numpy as np
import pytest

from tests.helpers import to_numpy


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a TensorFlow tracing property")
def test_build_and_compile_builds_the_slots_so_the_first_step_is_traced_once():
    """Optimizer slots created inside the first trace make TensorFlow trace the step again."""
    from keras_transformer.config import TransformerConfig
    from keras_transformer.train import build_and_compile

    config = TransformerConfig.from_preset("tiny", vocabulary_size=40)
    # Loss scaling and accumulation: the optimizer variables beyond Adam's own.
    model = build_and_compile(config, precision="mixed_float16", warmup_steps=2, accumulate_steps=2)
    assert model.optimizer.built
    traces = []
    step = model.train_step

    def counted(data):
        traces.append(data)
        return step(data)

    model.train_step = counted
    ids = np.random.default_rng(0).integers(3, 40, (4, 6)).astype("int32")
    model.fit({"source_ids": ids, "target_ids": ids}, ids, batch_size=2, epochs=1, verbose=0)
    assert len(traces) == 1
    assert int(to_numpy(model.optimizer.iterations)) == 1  # two batches, one update


@pytest.mark.jax
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="counts JAX's compilations")
def test_under_jax_the_train_step_compiles_once_per_batch_shape_and_a_second_epoch_never():
    """`few` batch shapes under JAX: the train step is jitted (compiled per shape, not op
    by op), the shapes are at most one per length bucket, and the second epoch, with
    its validation, compiles nothing new."""
    import jax

    from keras_transformer.config import TransformerConfig
    from keras_transformer.data.pipeline import BATCH_SHAPES, batch_pairs, encode_pairs
    from keras_transformer.data.tokenizer import train_sentencepiece
    from keras_transformer.data.toy import generate_toy_corpus
    from keras_transformer.train import build_and_compile

    corpus = generate_toy_corpus(num_train=200, num_valid=20, num_test=1, max_words=6)
    sources, targets = [s for s, _ in corpus.train], [t for _, t in corpus.train]
    tokenizer = train_sentencepiece(sources + targets, vocabulary_size=331)
    few = BATCH_SHAPES["few"]
    train = batch_pairs(encode_pairs(sources, targets, tokenizer, 24, few), 192, seed=1)[0]
    valid_pairs = [[s for s, _ in corpus.valid], [t for _, t in corpus.valid]]
    valid = batch_pairs(encode_pairs(*valid_pairs, tokenizer, 24, few), 192, shuffle=False)[0]
    shapes = {tuple(x["source_ids"].shape) for x, _ in train}
    assert len(shapes) <= few.bound(24)
    valid_shapes = {tuple(x["source_ids"].shape) for x, _ in valid}

    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            counts.append(len(compiles))

    counts = []
    config = TransformerConfig.from_preset(
        "tiny", vocabulary_size=tokenizer.vocabulary_size, num_layers=1, max_length=24
    )
    model = build_and_compile(config, precision="float32", warmup_steps=10)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        model.fit(train, validation_data=valid, epochs=2, verbose=0, callbacks=[Count()])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counts[0] > 0
    assert counts[1] == counts[0]  # nothing compiled in epoch 2
    # One train step per training shape and one test step per validation shape, and a
    # few small programs (15 on the machine this was written on). Op by op, every op of
    # a step would compile for every shape: hundreds.
    assert counts[0] <= len(shapes) + len(valid_shapes) + 8


@pytest.mark.jax
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX trainer's step")
def test_under_jax_the_two_program_train_step_trains_as_keras_own_step():
    """`build_and_compile` splits the JAX train step into gradients and the optimizer's
    update (`jax_step`). With this Keras it is installed, and three updates over two
    batch shapes give Keras' own step's weights, optimizer slots and logs."""
    from keras_transformer.config import TransformerConfig
    from keras_transformer.train import build_and_compile

    config = TransformerConfig.from_preset("tiny", vocabulary_size=40, num_layers=1)
    rng = np.random.default_rng(0)
    batches = []
    for rows, width in ((4, 6), (3, 9), (4, 6)):
        ids = rng.integers(3, 40, (rows, width)).astype("int32")
        ids[0, -2:] = 0  # padding, masked out of the loss
        batches.append(({"source_ids": ids, "target_ids": ids}, ids))

    def train(split):
        keras.utils.set_random_seed(0)
        model = build_and_compile(config, precision="float32", warmup_steps=2)
        if split:
            assert "make_train_function" in vars(model)  # the two-program step
        else:
            del model.make_train_function  # Keras' own
        before = to_numpy(model.trainable_variables[0])
        logs = [model.train_on_batch(x, y, return_dict=True) for x, y in batches]
        assert int(to_numpy(model.optimizer.iterations)) == 3
        assert not np.allclose(to_numpy(model.trainable_variables[0]), before)
        weights = [to_numpy(v) for v in model.trainable_variables + model.optimizer.variables]
        return logs, weights

    (keras_logs, keras_weights), (split_logs, split_weights) = train(False), train(True)
    assert len(split_weights) == len(keras_weights)
    for ours, theirs in zip(split_weights, keras_weights, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(split_logs, keras_logs, strict=True):
        assert ours.keys() == theirs.keys()
        for name in ours:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5)


@pytest.mark.jax
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="counts JAX's compilations")
def test_under_a_one_device_distribution_each_shape_compiles_once(caplog):
    """Under `keras.distribution.DataParallel` on one device, the first step's state is
    put on the mesh as the programs return it: the first shape is not compiled twice,
    and the optimizer's update compiles once in all."""
    import jax

    from keras_transformer.config import TransformerConfig
    from keras_transformer.train import build_and_compile

    config = TransformerConfig.from_preset("tiny", vocabulary_size=40, num_layers=1)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 40, shape).astype("int32") for shape in ((4, 6), (3, 9)) * 2]
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    jax.config.update("jax_log_compiles", True)
    try:
        model = build_and_compile(config, precision="float32", warmup_steps=2)
        with caplog.at_level("WARNING", logger="jax"):
            for x in ids:
                model.train_on_batch({"source_ids": x, "target_ids": x}, x)
    finally:
        jax.config.update("jax_log_compiles", False)
        keras.distribution.set_distribution(None)
    compiled = [r.getMessage() for r in caplog.records if "XLA compilation of" in r.getMessage()]
    assert sum("jit(gradients)" in m for m in compiled) == 2, compiled
    assert sum("jit(update)" in m for m in compiled) == 1, compiled


@pytest.mark.jax
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="counts JAX's compilations")
def test_compile_ahead_compiles_every_shape_before_fit_needs_it(caplog, recwarn):
    """`CompileAhead` compiles the gradients for each given batch shape and the update, two
    at a time, when `fit` begins; `fit` then compiles neither program again."""
    import jax

    from keras_transformer.config import TransformerConfig
    from keras_transformer.train import build_and_compile
    from keras_transformer.train.jax_step import CompileAhead

    config = TransformerConfig.from_preset("tiny", vocabulary_size=40, num_layers=1)
    shapes = [(4, 6), (2, 12), (8, 3)]
    rng = np.random.default_rng(0)
    x = [rng.integers(3, 40, shape).astype("int32") for shape in shapes * 2]
    messages = []

    class Listen(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            jax.config.update("jax_log_compiles", True)

    def batches():
        for ids in x:
            yield {"source_ids": ids, "target_ids": ids}, ids

    model = build_and_compile(config, precision="float32", warmup_steps=2)
    ahead = CompileAhead(shapes, threads=2, log=messages.append)
    try:
        with caplog.at_level("WARNING", logger="jax"):
            model.fit(_generated(batches), epochs=2, verbose=0, callbacks=[ahead, Listen()])
    finally:
        jax.config.update("jax_log_compiles", False)
    assert messages and "for 3 batch shapes ahead" in messages[0]
    compiled = [r.getMessage() for r in caplog.records if "XLA compilation of" in r.getMessage()]
    assert not [m for m in compiled if "jit(gradients)" in m or "jit(update)" in m], compiled
    assert int(to_numpy(model.optimizer.iterations)) == 12
    assert not [w for w in recwarn if "donated" in str(w.message)]  # every buffer reused


def _generated(batches):
    import tensorflow as tf

    ids = tf.TensorSpec((None, None), tf.int32)
    return tf.data.Dataset.from_generator(
        batches, output_signature=({"source_ids": ids, "target_ids": ids}, ids)
    )
