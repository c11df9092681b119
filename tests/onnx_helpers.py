"""What the ONNX export and runtime tests share: held-out sentences, graph walks,
the runtime command, and the model as the search specification sees it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from keras_transformer_runtime.specials import BOS_ID

# The mixed_float16 run's comparison is in the slow set (`make slow`) to keep
# the default run short; the float16 training run itself is in the default one.
KINDS = [
    "float32",
    "mixed_bfloat16",
    pytest.param("mixed_float16", marks=pytest.mark.slow),
]


def held_out_lines(count=240, seed=31):
    """Toy-language sentences from a seed that no training run here uses."""
    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=1, num_valid=1, num_test=count, max_words=8, seed=seed)
    return [source for source, _ in corpus.test]


def source_ids(tokenizer, lines):
    return [tokenizer.encode(line) + [tokenizer.eos_id] for line in lines]


def subgraphs(graph):
    """`graph` and the graphs inside it (a Loop's body)."""
    import onnx

    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from subgraphs(attribute.g)


def op_types(graph):
    """The operator types of `graph` and of the graphs inside it (a Loop's body)."""
    return {node.op_type for g in subgraphs(graph) for node in g.node}


def padded(rows):
    array = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array


def translate_command(out, lines, *flags, timeout=120):
    """`python -m keras_transformer_runtime.translate OUT FLAGS` with `lines` on stdin."""
    return subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.translate", str(out), *flags],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# The ONNX searches against the search specification: float32 round-off
# between the cached decoder step and the whole model's pass, summed over
# an output's tokens.
SPEC_SCORE_TOLERANCE = 1e-4


def spec_view(translator, source):
    """`log_probs(prefix)` of the export's teacher-forced pass (`teacher_forced.onnx`, no cache) for
    one source: the model as the search specification (`keras_transformer_runtime.spec`)
    sees it."""
    known = {}
    source = np.array([source], np.int32)

    def log_probs(prefix):
        if tuple(prefix) not in known:
            target = np.array([[BOS_ID, *prefix]], np.int32)
            known[tuple(prefix)] = translator.decoder.log_probs(source, target)[0, -1].astype(
                np.float64
            )
        return known[tuple(prefix)]

    return log_probs
