"""`OnnxTranslator`: the translation core (`translator.Translator`) over an ONNX export.

Example:

    translator = OnnxTranslator("runs/demo-onnx")
    translator.translate(["ko mina tel"], beam_size=4)
"""

from __future__ import annotations

from keras_transformer_runtime.onnx_decoder import OnnxDecoder
from keras_transformer_runtime.translator import Translator


class OnnxTranslator(Translator):
    """`Translator(OnnxDecoder(onnx_dir, ...), its tokenizer)`: see `onnx_decoder.OnnxDecoder`
    for the arguments and `translator.Translator` for the methods."""

    def __init__(self, onnx_dir, *settings, **named_settings):
        decoder = OnnxDecoder(onnx_dir, *settings, **named_settings)
        super().__init__(decoder, decoder.tokenizer)

    @property
    def onnx_dir(self):
        return self.decoder.onnx_dir

    @property
    def provider(self):
        """The execution provider that runs the decoder step."""
        return self.decoder.provider

    @property
    def precision(self):
        return self.decoder.precision

    @property
    def manifest(self):
        return self.decoder.manifest
