"""ONNX export of trained runs (the TensorFlow side; the runtime is `keras_transformer_runtime`)."""
