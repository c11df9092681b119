"""`train --init-from RUN`: another run's model shape, weights and tokenizer to start from
(an imported Marian model, or any run of ours), with text files or prepared data."""

from __future__ import annotations

import dataclasses

from keras_transformer.config import TransformerConfig
from keras_transformer.data.pipeline import DataError
from keras_transformer.translation import load_run


def init_config(settings) -> TransformerConfig:
    """The `--init-from` run's model config, with this run's dropout settings where given."""
    from keras_transformer.model import transformer_parts

    config = transformer_parts(load_run(settings.init_from)[0]).config
    changes = {
        name: getattr(settings, name)
        for name in ("dropout", "attention_dropout")
        if getattr(settings, name) is not None
    }
    return dataclasses.replace(config, **changes)


def check_prepared_for(settings, prepared) -> None:
    """With --init-from: the shards were encoded with that run's own tokenizer."""
    from keras_transformer.translation import load_tokenizer

    ours = load_tokenizer(settings.init_from).model_proto
    if prepared.tokenizer().model_proto != ours:
        raise DataError(
            f"{settings.data} was not encoded with the tokenizer of {settings.init_from}: "
            f"prepare it with --tokenizer-from {settings.init_from}."
        )
    limit = init_config(settings).max_length
    if prepared.max_length > limit:
        raise DataError(
            f"{settings.data} was prepared with max_length {prepared.max_length}, longer than "
            f"the model's {limit}: prepare it again with --max-length {limit} or less."
        )
