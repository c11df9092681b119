"""The weights of an export's graphs: one file per precision, each tensor once.

`share_weights` moves the weights of the graphs that translate into one
external-data file; `drop_unused_initializers` removes the constants no node
reads. Needs onnx.
"""

from __future__ import annotations

import os

# Weights of at least this many bytes go to the shared file, each at an
# offset aligned for memory mapping.
SHARED_MIN_BYTES = 1024
SHARED_ALIGNMENT = 4096


class ExportError(RuntimeError):
    """The model or the output folder cannot be exported to."""


def drop_unused_initializers(graph):
    """Removes the constants that no node of `graph` (or of a graph inside it) reads:
    the step's own selection constants, which a search graph replaces, would
    otherwise stay in its file and make ONNX Runtime warn on every load."""
    read = {name for g in subgraphs(graph) for node in g.node for name in node.input}
    read |= {output.name for g in subgraphs(graph) for output in g.output}
    for g in subgraphs(graph):
        kept = [tensor for tensor in g.initializer if tensor.name in read]
        if len(kept) < len(g.initializer):
            del g.initializer[:]
            g.initializer.extend(kept)


def subgraphs(graph):
    """`graph` and every graph inside it (a Loop's body), depth first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from subgraphs(attribute.g)
            for inner in attribute.graphs:
                yield from subgraphs(inner)


def share_weights(folder, files, weights_file):
    """Rewrites the graphs `files` (in `folder`) with their weights in `weights_file`,
    each distinct weight tensor once, and checks them.

    The decoder's weights sit in decoder_step.onnx and again in the loop body
    of each search graph, and the tied embedding table in the encoder too:
    stored inside each graph they took 2.6 times the disk with two search
    graphs (float32 Multi30k `small` export: 102.3 MB against 38.8 MB). ONNX external
    data lets every graph point at the same bytes. A tensor is shared when its
    type, shape and bytes are equal (names differ between the graphs); tensors
    under `SHARED_MIN_BYTES` stay inside their graph.
    """
    import hashlib

    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    models = {name: onnx.load(os.path.join(folder, name)) for name in files}
    placed = {}
    with open(os.path.join(folder, weights_file), "wb") as out:
        for model in models.values():
            for graph in subgraphs(model.graph):
                for tensor in graph.initializer:
                    data = np.ascontiguousarray(numpy_helper.to_array(tensor)).tobytes()
                    if len(data) < SHARED_MIN_BYTES:
                        continue
                    key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).digest())
                    if key not in placed:
                        padding = -out.tell() % SHARED_ALIGNMENT
                        out.write(b"\0" * padding)
                        placed[key] = out.tell()
                        out.write(data)
                    name, dims, data_type = tensor.name, list(tensor.dims), tensor.data_type
                    tensor.Clear()
                    tensor.name, tensor.data_type = name, data_type
                    tensor.dims.extend(dims)
                    tensor.data_location = TensorProto.EXTERNAL
                    for key_name, value in (
                        ("location", weights_file),
                        ("offset", placed[key]),
                        ("length", len(data)),
                    ):
                        entry = tensor.external_data.add()
                        entry.key, entry.value = key_name, str(value)
    for name, model in models.items():
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        onnx.checker.check_model(path, full_check=True)
