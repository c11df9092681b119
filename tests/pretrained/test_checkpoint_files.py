"""safetensors files read and written one tensor at a time (`checkpoint_files`)."""

import os

import numpy as np
import pytest

from keras_transformer.pretrained import marian_weights
from keras_transformer.pretrained.checkpoint_files import CheckpointTensors, write_safetensors
from keras_transformer.pretrained.marian import from_marian, read_config
from tests.pretrained.marian_dirs import numpy_checkpoint


def test_written_files_read_back_with_the_safetensors_library(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.normal(size=(7, 3)).astype(np.float32),
        "b": rng.normal(size=(5,)).astype(np.float16),
        "c": np.arange(6, dtype=np.int64).reshape(2, 3),
        "empty": np.zeros((0, 4), np.float32),
        "d": rng.normal(size=(2, 2, 2)).astype(np.float64)[:, ::2],  # not contiguous
    }
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, iter(tensors.items()), {"format": "pt"})
    read = load_file(path)
    assert sorted(read) == sorted(tensors)
    for name, value in tensors.items():
        assert read[name].dtype == value.dtype and np.array_equal(read[name], value)
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no scratch file left
    # Read back by rows, as an import reads the vocabulary matrices.
    lazy = CheckpointTensors(path)
    assert np.array_equal(lazy.rows("a.weight", 2, 5), tensors["a.weight"][2:5])
    assert lazy.shape("a.weight") == (7, 3) and "b" in lazy and len(lazy) == 5
    del lazy["b"]
    assert "b" not in lazy and sorted(lazy) == sorted(set(tensors) - {"b"})


def test_a_failing_writer_leaves_no_file(tmp_path):
    def tensors():
        yield "a", np.zeros(3, np.float32)
        raise RuntimeError("the model went away")

    path = str(tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="went away"):
        write_safetensors(path, tensors())
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="given twice"):
        write_safetensors(path, iter([("a", np.zeros(1)), ("a", np.zeros(1))]))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("variant", ["relu-shared-bias", "gelu-separate-bias", "relu-untied-3-1"])
def test_an_import_block_by_block_equals_one_from_whole_tensors(variant, tmp_path, monkeypatch):
    """The vocabulary matrices read and assigned a few rows at a time (the renumbering
    split across blocks) give the weights that whole tensors give."""
    from safetensors.numpy import load_file

    from keras_transformer.model import transformer_parts

    numpy_checkpoint(str(tmp_path), variant)
    monkeypatch.setattr(marian_weights, "ROW_BLOCK", 5)
    blocked, tokenizer = from_marian(str(tmp_path))
    whole, _ = from_marian(str(tmp_path))
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    hf = read_config(str(tmp_path))
    marian_weights.assign_weights(transformer_parts(whole), dict(tensors), tokenizer, hf)
    for a, b in zip(blocked.weights, whole.weights, strict=True):
        assert a.path == b.path and np.array_equal(np.asarray(a), np.asarray(b)), a.path


def test_rows_written_a_block_at_a_time_are_the_rows_taken_whole(tmp_path):
    from safetensors.numpy import load_file

    from keras_transformer.pretrained.checkpoint_files import SafetensorsWriter

    matrix = np.random.default_rng(1).normal(size=(9001, 3)).astype(np.float32)
    order = np.random.default_rng(2).permutation(9001)[:8999]
    path = str(tmp_path / "rows.safetensors")
    with SafetensorsWriter(path) as writer:
        writer.add("rows", matrix, order)
        writer.add("whole", matrix)
    read = load_file(path)
    np.testing.assert_array_equal(read["rows"], matrix[order])
    np.testing.assert_array_equal(read["whole"], matrix)


@pytest.mark.jax
@pytest.mark.parametrize("variant", ["relu-shared-bias", "gelu-separate-bias", "relu-untied-3-1"])
def test_a_run_written_one_weight_at_a_time_holds_the_model_from_marian(variant, tmp_path):
    """`import marian` writes each weight as Keras saves it, from a model built without
    values (`streamed_weights`): the run's weights are `from_marian`'s, and no
    variable of it is left for Keras to initialize later."""
    from keras_transformer.pretrained.marian import import_marian
    from keras_transformer.pretrained.streamed_weights import _pending_variables
    from keras_transformer.translation import load_run

    folder = str(tmp_path / "marian")
    numpy_checkpoint(folder, variant)
    pending = len(_pending_variables() or [])
    import_marian(folder, str(tmp_path / "run"))
    assert len(_pending_variables() or []) == pending
    written, _ = load_run(str(tmp_path / "run"))
    model, _ = from_marian(folder)
    assert len(written.weights) == len(model.weights)
    for a, b in zip(written.weights, model.weights, strict=True):
        assert a.path == b.path and np.array_equal(np.asarray(a), np.asarray(b)), a.path
