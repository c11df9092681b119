"""One way to write ONNX graphs node by node: `GraphBuilder`.

Every graph the export writes itself (the encoder, the decoder step, the
greedy and beam searches around it) is built with this class, so that each
reads the same way: one call per node, constants named where they are made,
and a helper for each pattern the graphs repeat (integer constants, shapes of
dimensions, filled tensors, dropping rows, copying the step graph into a loop
body).

A builder may carry a `prefix` for the values it names: a search graph's
loop body holds the decoder step's nodes as well as its own, and the prefix
(`"beam."`, `"greedy."`) keeps the two sets of names apart. Names passed to
`node` and `const` are prefixed; `output` writes a value under its exact
name, for graph outputs and the names the step graph reads (`top_k`).
"""

from __future__ import annotations

import numpy as np


class GraphBuilder:
    """Collects the nodes and constants of one ONNX graph.

    Args:
        prefix: prepended to every name the builder gives a value or a node.

    Example:

    ```python
    from onnx import TensorProto

    g = GraphBuilder()
    x = g.reshape("input", [-1, 4])  # (B * 2, 4)
    g.output("Relu", [x], "output")
    model = g.model(
        "relu",
        [g.value_info("input", TensorProto.FLOAT, ["batch", 8])],
        [g.value_info("output", TensorProto.FLOAT, ["rows", 4])],
        opset=17,
    )
    ```
    """

    def __init__(self, prefix=""):
        self.prefix = prefix
        self.nodes, self.initializers = [], []
        self._owner = self  # holds the constants and the node count
        self._count = 0
        self._constants = {}

    def body(self):
        """A builder for a loop body inside this graph: its own nodes, with the
        same prefix; its constants live in this (outer) graph, which the body
        reads, so that a value such as `int64s([1])` is made once for both."""
        body = GraphBuilder(self.prefix)
        body._owner = self._owner
        return body

    def name(self, name):
        """The full name of a value this builder named `name`."""
        return self.prefix + name

    def const(self, name, value, dtype=None):
        """Adds the constant `value` (as `dtype`) named `name`; returns its full name.

        Naming the same constant again returns the one already made; naming a
        different value the same is an error."""
        from onnx import numpy_helper

        full = self.prefix + name
        array = np.asarray(value, dtype)
        made = self._owner._constants
        if full in made:
            if made[full].dtype != array.dtype or not np.array_equal(made[full], array):
                raise ValueError(f"The constant {full!r} is already made with another value.")
            return full
        made[full] = array
        self._owner.initializers.append(numpy_helper.from_array(array, full))
        return full

    def int64s(self, values):
        """An int64 constant (a list gives a 1-D tensor, an int a scalar), made
        once per value: the shapes, axes and counts the graphs repeat."""
        text = "_".join(str(v) for v in np.ravel(values)).replace("-", "m")
        kind = "ints" if isinstance(values, (list, tuple)) else "int"
        return self.const(f"{kind}_{text}", values, np.int64)

    def node(self, op, inputs, outputs=None, **attributes):
        """Appends one `op` node reading `inputs` (full names).

        `outputs`: a name or a list of names (prefixed), or None for one output
        named after the op. Returns the full output name, or the list of them.
        """
        self._owner._count += 1
        if outputs is None:
            outputs = [f"{self.prefix}{op.lower()}_{self._owner._count}"]
        elif isinstance(outputs, str):
            outputs = [self.prefix + outputs]
        else:
            outputs = [self.prefix + name for name in outputs]
        self._append(op, inputs, outputs, attributes)
        return outputs[0] if len(outputs) == 1 else outputs

    def output(self, op, inputs, outputs, **attributes):
        """`node` whose outputs keep their exact names (no prefix)."""
        self._owner._count += 1
        names = [outputs] if isinstance(outputs, str) else list(outputs)
        self._append(op, inputs, names, attributes)
        return names[0] if len(names) == 1 else names

    def _append(self, op, inputs, outputs, attributes):
        from onnx import helper

        name = f"{self.prefix}{op}_{self._owner._count}"
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, **attributes))

    # ---- the patterns the graphs repeat

    def dimension(self, x, axis):
        """The size of `x` along `axis` as a (1,) int64 tensor."""
        return self.node("Shape", [x], start=axis, end=axis + 1)

    def unsqueeze(self, x, axes, outputs=None):
        return self.node("Unsqueeze", [x, self.int64s(list(axes))], outputs)

    def squeeze(self, x, axes, outputs=None):
        return self.node("Squeeze", [x, self.int64s(list(axes))], outputs)

    def reshape(self, x, shape, outputs=None):
        """`Reshape` to `shape`: a list of ints (a constant) or a tensor's name."""
        shape = self.int64s(list(shape)) if isinstance(shape, (list, tuple)) else shape
        return self.node("Reshape", [x, shape], outputs)

    def cast(self, x, to, outputs=None):
        return self.node("Cast", [x], outputs, to=to)

    def filled(self, shape, value, dtype, outputs=None):
        """A tensor of `shape` (a tensor's name) filled with `value` as `dtype`."""
        from onnx import numpy_helper

        fill = numpy_helper.from_array(np.full(1, value, dtype))
        return self.node("ConstantOfShape", [shape], outputs, value=fill)

    def keep_rows(self, keep, states, outputs):
        """Keeps the rows (axis 0) of each of `states` where `keep` ((rows,) bool)
        is True, writing `outputs`; returns their full names.

        Every state is copied at every step, even when no row is dropped: an
        `If` that copies only then measured slower, since ONNX Runtime copies
        the values that pass through its branches as well.
        """
        return [
            self.node("Compress", [state, keep], out, axis=0)
            for state, out in zip(states, outputs, strict=True)
        ]

    def any_true(self, x, outputs=None):
        """() bool: whether any element of the bool tensor `x` is True."""
        from onnx import TensorProto

        as_int = self.cast(x, TensorProto.INT32)
        return self.cast(self.node("ReduceMax", [as_int], keepdims=0), TensorProto.BOOL, outputs)

    def when(self, condition, branch, changes):
        """An `If` on `condition` (a () bool value): where it holds, the nodes of
        `branch` (a builder from `body()`) run; where not, none of them do.
        `changes`: `(output, made, unchanged, elem_type)` each, the `If`'s
        output `output` (a name, prefixed): the branch's value `made` where
        the condition holds, else a copy of `unchanged`. Returns the outputs'
        full names.

        In a loop body, this spares ONNX Runtime's per-node time at every step
        where the branch's work (say, booking finished hypotheses) has nothing
        to do; ONNX Runtime copies each output that an `If` passes through, so
        what passes should be small."""
        from onnx import helper

        infos = [self.value_info(made, elem_type) for _, made, _, elem_type in changes]
        then_graph = helper.make_graph(branch.nodes, f"{self.prefix}then", [], infos)
        skip = self.body()
        kept = [skip.node("Identity", [unchanged]) for _, _, unchanged, _ in changes]
        kept_infos = [self.value_info(k, c[3]) for k, c in zip(kept, changes, strict=True)]
        else_graph = helper.make_graph(skip.nodes, f"{self.prefix}else", [], kept_infos)
        outputs = [output for output, *_ in changes]
        return self.node("If", [condition], outputs, then_branch=then_graph, else_branch=else_graph)

    def extend(self, nodes):
        """Appends ready-made nodes (a copy of the step graph's, say)."""
        self.nodes.extend(nodes)

    # ---- graphs and models

    @staticmethod
    def value_info(name, elem_type, shape=None):
        from onnx import helper

        return helper.make_tensor_value_info(name, elem_type, shape)

    def graph(self, name, inputs, outputs, initializers=()):
        """The `onnx.GraphProto` of the nodes so far; `initializers` come before
        the builder's own constants (the step graph's weights in a loop body)."""
        from onnx import helper

        return helper.make_graph(
            self.nodes, name, inputs, outputs, list(initializers) + self.initializers
        )

    def model(self, name, inputs, outputs, opset=None, like=None):
        """The `onnx.ModelProto` of the graph so far: with `opset` (default
        domain, IR version at most 9), or with the opsets and IR version of the
        model `like` (a search graph is that of its decoder step)."""
        from onnx import helper

        opsets = list(like.opset_import) if like is not None else [helper.make_opsetid("", opset)]
        model = helper.make_model(
            self.graph(name, inputs, outputs),
            producer_name="keras-transformer",
            opset_imports=opsets,
        )
        model.ir_version = like.ir_version if like is not None else min(model.ir_version, 9)
        return model


def copied_nodes(nodes, prefix="", names=None, keep=()):
    """Copies of `nodes` for another place in a graph (another decoder step in
    the same loop body): an input named in `names` is read as `names[x]`;
    with a `prefix`, every other value the nodes make or read is renamed
    `prefix + x`, except those in `keep` (weights and constants that the
    copies share)."""
    names = names or {}
    copies = []
    for node in nodes:
        copy = type(node)()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            if name in names:
                copy.input[i] = names[name]
            elif name and prefix and name not in keep:
                copy.input[i] = prefix + name
        if prefix:
            for i, name in enumerate(copy.output):
                copy.output[i] = prefix + name
            if copy.name:
                copy.name = prefix + copy.name
        for attribute in copy.attribute:  # an If's branches read the same names
            if attribute.HasField("g"):
                _rename_graph(attribute.g, prefix, names, keep)
        copies.append(copy)
    return copies


def _rename_graph(graph, prefix, names, keep):
    """`copied_nodes`' renaming, in place, of a subgraph's nodes and outputs."""
    nodes = copied_nodes(graph.node, prefix, names, keep)
    del graph.node[:]
    graph.node.extend(nodes)
    for value in graph.output:
        if value.name in names:
            value.name = names[value.name]
        elif prefix and value.name not in keep:
            value.name = prefix + value.name
