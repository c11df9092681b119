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
