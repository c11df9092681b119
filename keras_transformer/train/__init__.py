"""Training on parallel text files: the `keras-transformer train` command.

The package in the order a run goes through it: `settings` (every option,
defined once), `run_dir` (the run directory and resuming), `stages` (the
stages of `train`), `compile` (the model built and compiled for training),
`callbacks` (what `model.fit` runs each epoch) and `checkpoints` (ranking
epochs and averaging their checkpoints).

A run directory holds everything a run needs and produces:

- `train_config.json`: the settings that define the run; a rerun with other
  settings is refused (the settings that only say when to stop or how to
  finish, `RESUMABLE_FIELDS`, may change: a finished run can be extended or
  finished another way).
- `spm.model`: the joint SentencePiece model, trained on the first start.
- `backup/`: Keras `BackupAndRestore` state (weights and optimizer) of the last
  completed epoch, replaced as one step (`backup.py`); rerunning the same command resumes from it, with data
  order and dropout masks drawn anew (`stream_seed`), not replayed.
- `checkpoints/epoch-NNN.weights.h5`: the weights after the last epochs and
  after the best ones on validation, for choosing and averaging.
- `history.json`: per-epoch losses, validation measures, seconds and steps,
  and the precision and device (GPU, or CPU model) each epoch trained on.
- `model.keras`, `config.json`, `metrics.json`, and TensorBoard logs in `logs/`.

Choosing on validation: every epoch is scored on the validation set by loss
or by BLEU (`select_by`); `patience` stops a run that has not improved for
that many epochs; at the end the saved weights are the candidate that scores
best on validation among the last epoch, the best epoch, and the means of the
last k and of the best k epochs for k up to `average` (`final="auto"`), or
the one kind asked for (`final="last"` or `"best"`).
"""

from keras_transformer.train.checkpoints import average_checkpoints
from keras_transformer.train.compile import build_and_compile
from keras_transformer.train.run_dir import RunDirectoryError
from keras_transformer.train.settings import TrainSettings
from keras_transformer.train.stages import train

__all__ = [
    "RunDirectoryError",
    "TrainSettings",
    "average_checkpoints",
    "build_and_compile",
    "train",
]
