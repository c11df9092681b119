"""Shortlisted decoder steps: recognising them, and splitting them for a search loop.

A shortlisted step (`step_graph.build_decoder_step(..., shortlist=True)`)
scores only the vocabulary ids of its `shortlist` input. A search graph
built around it gathers the listed rows once, before its loop (`hoisted`).
"""

from __future__ import annotations

from keras_transformer.export.step_graph import step_vocabulary_size


def is_shortlisted(step):
    """Whether the decoder-step graph `step` scores a `shortlist` input's ids only."""
    return any(value.name == "shortlist" for value in step.graph.input)


def mark_vocabulary_size(step):
    """Records the vocabulary size in `step`'s properties, where a search graph
    built from it finds it once its ban has moved out of the loop (`hoisted`)."""
    from onnx import helper

    size = str(step_vocabulary_size(step))
    helper.set_model_props(
        step, {p.key: p.value for p in step.metadata_props} | {"vocabulary_size": size}
    )
    return step


def hoisted(step):
    """`step` split for a search loop: `(the step without the nodes that depend only
    on its `shortlist` input and its weights, those nodes, the weights only they
    read)`. A loop over a shortlisted step gathers the listed rows of the output
    matrix (and bias) once, before the loop, instead of at every step; the body
    reads them, and the weights it shares with those nodes, from the outer graph.
    A step without a shortlist comes back whole, with nothing hoisted."""
    if not is_shortlisted(step):
        return step, [], []
    step = mark_vocabulary_size(step)
    weights = {t.name for t in step.graph.initializer}
    invariant, moved, kept = {"shortlist"}, [], []
    for node in step.graph.node:  # in topological order
        inputs = [name for name in node.input if name]
        if any(name in invariant for name in inputs) and all(
            name in invariant or name in weights for name in inputs
        ):
            moved.append(node)
            invariant.update(node.output)
        else:
            kept.append(node)
    read = {name for node in moved for name in node.input if name in weights}
    copy = type(step)()
    copy.CopyFrom(step)
    del copy.graph.node[:]
    copy.graph.node.extend(kept)
    outer = [t for t in copy.graph.initializer if t.name in read]
    body = [t for t in copy.graph.initializer if t.name not in read]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(body)
    return copy, moved, outer
