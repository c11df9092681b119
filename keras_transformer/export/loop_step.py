"""A decoder-step graph split for a search loop: what need not run at every step.

The search graphs run the decoder step inside an ONNX `Loop`, where each node
runs, and costs ONNX Runtime's per-node time, at every step. Parts of the
step are moved before the loop (`hoisted`):

- a shortlisted step's gather of the listed rows of the output matrix (and
  bias), which reads only the `shortlist` input and weights: done once;
- the sinusoids of the step's position (`step_graph.position_encoding`, about
  fifteen nodes): computed once for every position the loop can reach, the
  body then reads its row with one `Gather`. The values are those of the same
  nodes, run on all positions at once. Measured on a one-layer student
  (docs/performance.md, "Position table"): 1.02-1.03x at batch 1, nothing at 32;
- in the graphs that keep their sentences to the end (`greedy_search`,
  `beam_search`), what the step makes of the sentences' inputs alone (the
  attention mask's bias, shapes read off the source): done once.
"""

from __future__ import annotations

from keras_transformer.export.graph_builder import GraphBuilder, copied_nodes
from keras_transformer.export.shortlisted import is_shortlisted, mark_vocabulary_size
from keras_transformer.export.weights import drop_unused_initializers

# The step graph's name for its position, `(1,) int64`, read off the cache length.
POSITION = "position"


def search_graph(build, step, steps_per_iteration=None, fixed_sentences=False):
    """The search graph `build(step)` (or `build(step, steps_per_iteration)`) over
    `step` split by `hoisted`, the moved nodes run before its loop.
    `fixed_sentences`: the loop body reads the search graph's own `source_mask`
    and cross keys and values at every step (a graph that keeps every sentence
    to the end, not one that drops finished ones): what the step makes of those
    alone moves before the loop too."""
    steps = steps_per_iteration or 1
    step, before_loop, outer_weights = hoisted(step, steps, fixed_sentences)
    search = build(step) if steps_per_iteration is None else build(step, steps)
    for i, node in enumerate(before_loop):
        search.graph.node.insert(i, node)
    search.graph.initializer.extend(outer_weights)
    drop_unused_initializers(search.graph)
    return search


def hoisted(step, steps_per_iteration=1, fixed_sentences=False):
    """`step` split for a search loop: `(the step without the nodes moved out of it,
    the nodes the search graph runs before its loop, the weights only those read)`.

    The search graph must take `limits (sentences,) int64`, its sentences'
    maximum output lengths; a loop making `steps_per_iteration` steps per
    iteration may reach that many positions past the largest. The body reads
    what the moved nodes make, and weights it shares with them, from the
    outer graph. `fixed_sentences`: as in `search_graph`."""
    weights = {t.name for t in step.graph.initializer}  # wherever they end up
    step, moved, outer = _listed_rows(step, weights)
    if fixed_sentences:
        step, of_sentences, read = _sentence_values(step, weights)
        moved, outer = moved + of_sentences, outer + read
    step, before, tables = _position_table(step, weights, steps_per_iteration)
    return step, moved + before, outer + tables


def _split(step, seeds, weights):
    """`(the nodes that read only seeds, `weights` and each other's outputs (in
    order), the other nodes, the weights the first read, the values they make)`."""
    invariant, moved, kept = set(seeds), [], []
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
    return moved, kept, read, invariant - set(seeds)


def _rebuilt(step, nodes, outer_weights):
    """A copy of `step` with `nodes` and without the initializers `outer_weights`
    names; returns it and those initializers."""
    copy = type(step)()
    copy.CopyFrom(step)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    outer = [t for t in copy.graph.initializer if t.name in outer_weights]
    body = [t for t in copy.graph.initializer if t.name not in outer_weights]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(body)
    return copy, outer


def _listed_rows(step, weights):
    """A shortlisted step's nodes that depend only on its `shortlist` input and
    its weights, moved out (the listed rows of the output matrix and bias,
    gathered once); a step without a shortlist comes back whole."""
    if not is_shortlisted(step):
        return step, [], []
    step = mark_vocabulary_size(step)
    moved, kept, read, _ = _split(step, ["shortlist"], weights)
    step, outer = _rebuilt(step, kept, read)
    return step, moved, outer


def _sentence_values(step, weights):
    """The step's nodes that read only its sentences' inputs (`source_mask`, the
    cross keys and values) and weights, moved out: the attention mask's bias
    and the shapes taken from the source, the same at every step of a loop
    whose sentences stay (about six nodes per step)."""
    seeds = [v.name for v in step.graph.input if v.name == "source_mask"]
    seeds += [v.name for v in step.graph.input if v.name.startswith("cross_")]
    moved, kept, read, _ = _split(step, seeds, weights)
    step, outer = _rebuilt(step, kept, read)
    return step, moved, outer


def _position_table(step, weights, steps_per_iteration):
    """The nodes that make the sinusoids of `POSITION`, moved out and run on
    every position from 0 to the largest limit plus `steps_per_iteration`; the
    step reads its row of that table. A step without `POSITION` (none made by
    an older builder) comes back whole."""
    from onnx import helper

    if not any(POSITION in node.output for node in step.graph.node):
        return step, [], []
    moved, kept, read, made = _split(step, [POSITION], weights)
    used = {name for node in kept for name in node.input} | {v.name for v in step.graph.output}
    ends = sorted(made & used)
    if len(ends) != 1:
        raise ValueError(f"The decoder step's position encoding ends in {ends}, not one value.")
    g = GraphBuilder("position_table.")
    longest = g.node("ReduceMax", ["limits"], "longest", keepdims=0)
    count = g.node("Add", [longest, g.int64s(steps_per_iteration)], "count")
    every = g.node("Range", [g.int64s(0), count, g.int64s(1)], "positions")
    g.extend(copied_nodes(moved, g.prefix, {POSITION: every}, weights))
    table = g.prefix + ends[0]
    row = helper.make_node("Gather", [table, POSITION], ends, name="position_row", axis=0)
    at = next(i for i, node in enumerate(kept) if POSITION in node.output) + 1
    step, outer = _rebuilt(step, kept[:at] + [row] + kept[at:], read)
    return step, g.nodes, outer + g.initializers
