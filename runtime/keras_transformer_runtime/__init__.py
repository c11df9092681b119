"""keras-transformer's ONNX Runtime translator: numpy, onnxruntime and sentencepiece only.

`keras-transformer export` (the TensorFlow side) writes the folder that
`OnnxTranslator` loads; `keras-transformer-translate` is its command line.
"""

from keras_transformer_runtime.runtime import ExportFileError, OnnxTranslator

__all__ = ["ExportFileError", "OnnxTranslator"]
