"""Model configuration: one dataclass and the named presets."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from keras_transformer.checks import (
    check_activation,
    check_positional_layout,
    check_positive_int,
    check_rate,
)

_SMALL = dict(
    num_layers=3,
    hidden_dim=256,
    intermediate_dim=1024,
    num_heads=4,
    dropout=0.1,
    vocabulary_size=8000,
    max_length=128,
)

PRESETS: dict[str, dict[str, Any]] = {
    # Table 3 of the paper, "base" row.
    "paper-base": dict(
        num_layers=6, hidden_dim=512, intermediate_dim=2048, num_heads=8, dropout=0.1
    ),
    # Table 3 of the paper, "big" row (dropout 0.3 as used for EN-DE).
    "paper-big": dict(
        num_layers=6, hidden_dim=1024, intermediate_dim=4096, num_heads=16, dropout=0.3
    ),
    # Sized for Multi30k (~30k sentence pairs) on a small CPU machine; dropout
    # 0.1 as in the Multi30k recipe (benchmarks/results/multi30k/), which a
    # 10-epoch budget leaves under- rather than over-fitted.
    "small": _SMALL,
    # Students for fast CPU decoding: `small`'s width with a deep encoder and a
    # shallow decoder, as the WMT efficiency tasks' winners and Bergamot's
    # students are built (the decoder runs once per output token, the encoder
    # once per sentence). Pre-norm: six post-norm layers do not train at
    # `small`'s peak learning rate and 1024-token batches (docs/performance.md,
    # "Multi30k recipe proxies"; a post-norm 6-1 student was at 3.4 val BLEU
    # after 3 epochs).
    "student-6-1": {**_SMALL, "num_layers": 6, "num_decoder_layers": 1, "normalize_first": True},
    "student-6-2": {**_SMALL, "num_layers": 6, "num_decoder_layers": 2, "normalize_first": True},
    # Unit tests and the built-in demo.
    "tiny": dict(
        num_layers=2,
        hidden_dim=64,
        intermediate_dim=256,
        num_heads=4,
        dropout=0.0,
        vocabulary_size=64,
        max_length=48,
    ),
}


# The shape fields a run may override on its preset (`preset_config`).
SHAPE_FIELDS = (
    "num_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "hidden_dim",
    "intermediate_dim",
    "num_heads",
)
# Those a run started from another (`train --init-from`) may still give: fewer layers.
DEPTH_FIELDS = SHAPE_FIELDS[:3]


@dataclasses.dataclass
class TransformerConfig:
    """Hyper-parameters of an encoder-decoder Transformer.

    Build one with `TransformerConfig.from_preset(name, **overrides)` or
    directly with keyword arguments.
    """

    # Size of the joint (source and target) vocabulary; id 0 is padding.
    vocabulary_size: int = 37000
    # Number of encoder layers and of decoder layers (N in the paper).
    num_layers: int = 6
    # Model width d_model: embeddings, attention and residual stream.
    hidden_dim: int = 512
    # Inner width d_ff of the position-wise feed-forward network.
    intermediate_dim: int = 2048
    # Number of attention heads h; hidden_dim must be divisible by it.
    num_heads: int = 8
    # Dropout rate P_drop on embeddings, sublayer outputs and attention weights.
    dropout: float = 0.1
    # Dropout on the attention weights alone; None = `dropout`. The paper drops
    # only embeddings and sublayer outputs (0 here); with 0, training can take
    # the fused attention kernel (keras_transformer.ops.set_fused_attention).
    attention_dropout: float | None = None
    # Longest sequence (in tokens, BOS/EOS included) the positional table covers.
    max_length: int = 256
    # Share one embedding between source, target and the output projection (section 3.4).
    tie_embeddings: bool = True
    # False: post-norm as in the paper; True: pre-norm (LayerNorm before each sublayer).
    normalize_first: bool = False
    # Epsilon of every LayerNormalization.
    layer_norm_epsilon: float = 1e-6
    # Encoder and decoder depths when they differ (a deep encoder with a
    # shallow decoder decodes faster); None = `num_layers`.
    num_encoder_layers: int | None = None
    num_decoder_layers: int | None = None
    # The feed-forward activation: "relu" (the paper), "swish" or "gelu".
    activation: str = "relu"
    # The sinusoid layout: "interleaved" (the paper's sin/cos pairs) or
    # "concatenated" (all sines, then all cosines: Marian and tensor2tensor).
    positional_layout: str = "interleaved"
    # Factor on the token embeddings; None = sqrt(hidden_dim) (section 3.4).
    embedding_scale: float | None = None
    # A learned bias on the output logits (Marian's `final_logits_bias`).
    output_bias: bool = False
    # With tie_embeddings False: whether the decoder's embedding is still the
    # output projection (Marian's separate vocabularies), or a Dense of its own.
    tie_decoder_output: bool = False
    # Source vocabulary size when the source has its own vocabulary (with
    # tie_embeddings False); None = `vocabulary_size`.
    source_vocabulary_size: int | None = None
    # Whether the decoder's start token (BOS) embeds as a zero vector that training
    # keeps zero: Marian's decoder start, which CTranslate2 assumes of its models.
    zero_start_embedding: bool = False

    def __post_init__(self):
        if self.num_encoder_layers is None:
            self.num_encoder_layers = self.num_layers
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.source_vocabulary_size is None:
            self.source_vocabulary_size = self.vocabulary_size
        for name in (
            "vocabulary_size",
            "num_layers",
            "hidden_dim",
            "intermediate_dim",
            "num_heads",
            "max_length",
            "num_encoder_layers",
            "num_decoder_layers",
            "source_vocabulary_size",
        ):
            check_positive_int(name, getattr(self, name))
        check_activation(self.activation)
        check_positional_layout(self.positional_layout)
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            raise ValueError(
                f"embedding_scale must be positive or None. Received: {self.embedding_scale!r}"
            )
        if self.tie_embeddings and self.source_vocabulary_size != self.vocabulary_size:
            raise ValueError(
                "tie_embeddings shares one embedding between source and target, so "
                "source_vocabulary_size must equal vocabulary_size. Received: "
                f"{self.source_vocabulary_size} and {self.vocabulary_size}"
            )
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                "hidden_dim must be divisible by num_heads. Received: "
                f"hidden_dim={self.hidden_dim}, num_heads={self.num_heads}"
            )
        check_rate("dropout", self.dropout)
        if self.attention_dropout is not None:
            check_rate("attention_dropout", self.attention_dropout)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """Returns the preset `name` with `overrides` applied."""
        if name not in PRESETS:
            raise ValueError(
                f"Unknown preset {name!r}. Available presets: {', '.join(sorted(PRESETS))}"
            )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown config fields: {', '.join(sorted(unknown))}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"Unknown config fields: {', '.join(sorted(unknown))}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def preset_config(
    preset, vocabulary_size, dropout=None, attention_dropout=None, normalize_first=None, **shape
):
    """The `TransformerConfig` of a run: the preset with the run's vocabulary and overrides.

    `shape` takes `SHAPE_FIELDS`; a None value keeps the preset's. `num_layers`
    sets both depths, unless `num_encoder_layers` or `num_decoder_layers` sets one.
    """
    unknown = set(shape) - set(SHAPE_FIELDS)
    if unknown:
        raise ValueError(f"Unknown shape fields: {', '.join(sorted(unknown))}")
    if shape.get("num_layers") is not None:
        for depth in ("num_encoder_layers", "num_decoder_layers"):
            if shape.get(depth) is None:
                shape[depth] = shape["num_layers"]
    overrides = {"vocabulary_size": vocabulary_size}
    for name, value in (
        ("dropout", dropout),
        ("attention_dropout", attention_dropout),
        ("normalize_first", normalize_first),
        *shape.items(),
    ):
        if value is not None:
            overrides[name] = value
    return TransformerConfig.from_preset(preset, **overrides)
