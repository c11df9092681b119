"""Shortlisted decoder steps: recognising them.

A shortlisted step (`step_graph.build_decoder_step(..., shortlist=True)`)
scores only the vocabulary ids of its `shortlist` input. A search graph
built around it gathers the listed rows once, before its loop
(`loop_step.hoisted`).
"""

from __future__ import annotations

from keras_transformer.export.step_graph import step_vocabulary_size


def is_shortlisted(step):
    """Whether the decoder-step graph `step` scores a `shortlist` input's ids only."""
    return any(value.name == "shortlist" for value in step.graph.input)


def mark_vocabulary_size(step):
    """Records the vocabulary size in `step`'s properties, where a search graph
    built from it finds it once its ban has moved out of the loop (`loop_step.hoisted`)."""
    from onnx import helper

    size = str(step_vocabulary_size(step))
    helper.set_model_props(
        step, {p.key: p.value for p in step.metadata_props} | {"vocabulary_size": size}
    )
    return step
