# Before any benchmark loads TensorFlow: its oneDNN kernels, as importing
# keras_transformer gives users (keras_transformer.startup.prefer_onednn), so
# every TensorFlow peer runs on them. Set here without importing the package,
# which imports Keras: a torch-only child process stays free of TensorFlow.
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
