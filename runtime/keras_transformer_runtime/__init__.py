"""Translate with keras-transformer's ONNX exports: numpy, onnxruntime and sentencepiece only.

`OnnxTranslator` is the translation core (`translator.Translator`) over an
export's graphs (`onnx_decoder.OnnxDecoder`).
"""

from keras_transformer_runtime.export_format import ExportFileError
from keras_transformer_runtime.onnx_translator import OnnxTranslator
from keras_transformer_runtime.translator import Translator

__all__ = ["ExportFileError", "OnnxTranslator", "Translator"]
