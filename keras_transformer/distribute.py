"""Choosing how a run spreads over devices: one device, `tf.distribute` on one machine,
or JAX's `keras.distribution` over the devices of several processes (hosts).

- `"default"`: one device.
- `"mirrored"`: `tf.distribute.MirroredStrategy`, the model copied onto every
  GPU of this machine (or the given devices); TensorFlow backend.
- `"data-parallel"`: `keras.distribution.DataParallel` over the devices of every
  process of the run, on one host or many; JAX backend
  (`keras_transformer.train.data_parallel`).

Both split each global batch across the devices and sum the gradients;
`LabelSmoothedCrossEntropy` divides by the real-token count of the global
batch, so the update equals the one-device update on the same batch.
"""

from __future__ import annotations

STRATEGIES = ("default", "mirrored", "data-parallel")

# Names a run may no longer use: {name: what to do instead}.
RETIRED_STRATEGIES = {
    "multi-worker": (
        "--strategy multi-worker (tf.distribute.MultiWorkerMirroredStrategy, which Keras 3 does "
        "not support) was replaced by --strategy data-parallel: start every process with "
        "KERAS_BACKEND=jax and --coordinator HOST:PORT --num-processes N --process-id I "
        "(see docs/distributed.md)."
    ),
}


def check_strategy(name: str) -> None:
    """Raises a `ValueError` naming the choices, or the replacement of a retired name."""
    if name in RETIRED_STRATEGIES:
        raise ValueError(RETIRED_STRATEGIES[name])
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}. Received: {name!r}")


def make_strategy(name: str = "default", devices=None):
    """Returns the `tf.distribute.Strategy` called `name` (TensorFlow backend).

    Args:
        name: `"default"` (one device) or `"mirrored"` (all GPUs of this
            machine, or `devices`). `"data-parallel"` is not a
            `tf.distribute` strategy: see
            `keras_transformer.train.data_parallel.start_data_parallel`.
        devices: list of str. Devices for `"mirrored"`, e.g. `["/cpu:0", "/cpu:1"]`.
    """
    import keras

    check_strategy(name)
    if name == "data-parallel":
        raise ValueError(
            "strategy 'data-parallel' runs on JAX (keras.distribution), not tf.distribute: "
            "use keras_transformer.train.data_parallel.start_data_parallel()."
        )
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "tf.distribute strategies need the TensorFlow backend; "
            f"KERAS_BACKEND is {keras.backend.backend()!r}."
        )
    import tensorflow as tf

    if name == "default":
        return tf.distribute.get_strategy()
    return tf.distribute.MirroredStrategy(devices=devices)
