"""Cross-attention plots: which source pieces each output piece attended to."""

from __future__ import annotations

import numpy as np

from keras_transformer.io_utils import atomic_path


def attention_figure_data(model, tokenizer, source_text: str, beam_size: int = 4, layer: int = -1):
    """Translates `source_text` and returns what `plot_attention` draws.

    Returns:
        `(weights, source_pieces, target_pieces, translation)`: `weights` is
        `(target_len, source_len)`, the cross-attention of decoder layer
        `layer` averaged over heads, for the output pieces plus EOS (rows)
        against the source pieces plus EOS (columns).
    """
    from keras import ops

    from keras_transformer.decoding import beam_search, greedy_search
    from keras_transformer.model import transformer_parts

    source = tokenizer.encode(source_text) if source_text.strip() else []
    if not source:
        raise ValueError("Cannot plot attention for an empty sentence.")
    source = source + [tokenizer.eos_id]
    if beam_size == 1:
        tokens, _ = greedy_search(model, [source])
    else:
        tokens, _ = beam_search(model, [source], beam_size=beam_size)
    output = [int(t) for t in tokens[0]]
    parts = transformer_parts(model)
    # Row i is the step that predicts rows[i]; an output that reached the
    # model's max_length without EOS keeps only the steps that fit.
    limit = parts.config.max_length
    rows = (output + [tokenizer.eos_id])[:limit]
    decoder_input = np.asarray([([tokenizer.bos_id] + output)[:limit]], np.int32)
    all_layers = parts.cross_attention_weights(np.asarray([source], np.int32), decoder_input)
    try:
        chosen = all_layers[layer]
    except IndexError:
        raise ValueError(
            f"layer={layer} is out of range: the model has {len(all_layers)} decoder layers."
        ) from None
    weights = np.mean(ops.convert_to_numpy(chosen)[0], axis=0)  # (T, S)
    source_pieces = tokenizer.source_pieces(source[:-1]) + ["</s>"]
    target_pieces = ["</s>" if t == tokenizer.eos_id else tokenizer.pieces([t])[0] for t in rows]
    return weights, source_pieces, target_pieces, tokenizer.decode(output)


def plot_attention(weights, source_pieces, target_pieces, path: str, title: str = "") -> None:
    """Draws `weights` `(len(target_pieces), len(source_pieces))` as a heat map into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = np.asarray(weights)
    if weights.shape != (len(target_pieces), len(source_pieces)):
        raise ValueError(
            f"weights have shape {weights.shape} but there are {len(target_pieces)} target "
            f"and {len(source_pieces)} source pieces."
        )
    width = max(4.0, 0.42 * len(source_pieces) + 2.0)
    height = max(3.0, 0.36 * len(target_pieces) + 1.5)
    figure, axes = plt.subplots(figsize=(width, height))
    image = axes.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto")
    axes.set_xticks(range(len(source_pieces)), source_pieces, rotation=60, ha="right")
    axes.set_yticks(range(len(target_pieces)), target_pieces)
    axes.set_xlabel("source pieces")
    axes.set_ylabel("output pieces")
    if title:
        axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, fraction=0.04)
    figure.tight_layout()
    suffix = "." + path.rsplit(".", 1)[-1] if "." in path else ".png"
    try:
        with atomic_path(path, suffix=suffix) as tmp:
            figure.savefig(tmp, dpi=120)
    finally:
        plt.close(figure)
