"""Whole training steps behind the two switches of the training step.

Each experiment builds its variants in one process (paper-base shapes,
`--layers` layers a side, one batch of about `--rows` tokens per side),
checks that their first losses agree, and times them interleaved over
`--rounds` rounds; it prints the median per variant. Both run on any
backend.

    gradients   a training step (`train_on_batch`) of the model with the
                hand-written gradients (attention projections, feed-forward
                products, layer norm, loss;
                keras_transformer.ops.hand_written_gradients), with each of
                them left to automatic differentiation, with none, with
                their column sums as plain sums
                (keras_transformer.ops.linear.column_sum), and with their
                input gradients through transpose_b
                (keras_transformer.ops.linear.transposed_copy)
    attention   the model with attention dropout 0, a training step and a
                forward pass, with attention through the plain expression
                and through keras.ops.dot_product_attention
                (keras_transformer.ops.set_fused_attention), with the key
                lengths (ops.padded_attention, JAX on a GPU) or the mask

    python -m benchmarks.ablations gradients --rows 12000 --layers 6 --rounds 3
    KERAS_BACKEND=jax python -m benchmarks.ablations gradients --rows 25000 --layers 2
    python -m benchmarks.ablations attention --rows 4000 --layers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

EXPERIMENTS = ("gradients", "attention")


def _interleaved(fns, rounds):
    """Median seconds of each zero-argument function, timed round-robin."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _sum_rows(x):
    from keras import ops

    return ops.sum(x, axis=0)


def _folded_transpose(x):
    from keras import ops

    return ops.transpose(x)


HAND_WRITTEN = "hand-written (TensorFlow's default)"


def _gradient_patches():
    """Variant name -> [(object, attribute, replacement)] for `gradients_variants`."""
    linear = importlib.import_module("keras_transformer.ops.linear")
    gradients = importlib.import_module("keras_transformer.ops.gradients")

    def hand_written(*parts):
        return [(gradients, "hand_written_gradients", lambda part: part in parts)]

    every = gradients.HAND_WRITTEN_PARTS
    variants = {HAND_WRITTEN: hand_written(*every)}
    for part in every:
        variants[f"autodiff {part}"] = hand_written(*(p for p in every if p != part))
    # Hand-written passes, their bias and layer-norm reductions as plain sums.
    variants["sum reductions"] = hand_written(*every) + [(linear, "column_sum", _sum_rows)]
    # Hand-written passes, their input gradients through the transpose_b flag.
    variants["transpose_b products"] = hand_written(*every) + [
        (linear, "transposed_copy", _folded_transpose)
    ]
    variants["hand-written loss only (other backends' default)"] = hand_written("loss")
    variants["all autodiff"] = hand_written()
    return variants


class _Patched:
    """Sets attributes for the duration of a `with` block, then restores them."""

    def __init__(self, patches):
        self.patches = patches

    def __enter__(self):
        self.saved = [(o, a, getattr(o, a)) for o, a, _ in self.patches]
        for obj, attribute, value in self.patches:
            setattr(obj, attribute, value)

    def __exit__(self, *exc):
        for obj, attribute, value in self.saved:
            setattr(obj, attribute, value)


def _model_step_variants(rows, layers, policy, variants, reference, forward=False, **overrides):
    """Paper-base models built and stepped under each variant's patches; their first losses agree.

    Each variant's model is built with the same seed, so the first steps see
    the same weights and the same batch. `forward=True` also times a forward
    pass (`predict_on_batch`) of each model beside its training step.
    """
    import numpy as np

    from benchmarks.throughput.batches import make_batches, training_flops
    from benchmarks.throughput.peers.keras_peers import KerasPeer
    from keras_transformer import TransformerConfig, build_transformer

    config = TransformerConfig.from_preset(
        "paper-base", vocabulary_size=37000, num_layers=layers, **overrides
    )
    (batch,) = make_batches(config.max_length, rows, 1, config.vocabulary_size)
    fns, first_losses = {}, {}
    for name, patches in variants.items():
        # Patched while the model is built and its step traced (the first call).
        with _Patched(patches):
            # Seeded, built under `policy` and compiled as the throughput benchmark's peers.
            peer = KerasPeer(name, build_transformer, config, policy)
            prepared = peer.prepare(batch)
            start = time.perf_counter()
            first_losses[name] = peer.step(prepared)
            if forward:
                peer.model.predict_on_batch(prepared[0])
        print(f"  {name}: built, first step {time.perf_counter() - start:.1f} s", flush=True)
        label = f"{name}: train step" if forward else name
        fns[label] = lambda peer=peer, prepared=prepared: peer.step(prepared)
        if forward:
            fns[f"{name}: forward"] = lambda peer=peer, x=prepared[0]: peer.model.predict_on_batch(
                x
            )
    for name, loss in first_losses.items():  # same weights, same batch: the same loss
        assert np.isclose(loss, first_losses[reference], rtol=1e-4), (name, loss, reference)
    return fns, training_flops(config, batch["source_lengths"], batch["target_lengths"])


def gradients_variants(rows, layers=6, names=None, policy="float32"):
    variants = _gradient_patches()
    names = list(variants) if not names else [HAND_WRITTEN] + list(names)
    unknown = sorted(set(names) - set(variants))
    if unknown:
        raise SystemExit(f"unknown gradients variants {unknown}; known: {list(variants)}")
    chosen = {name: variants[name] for name in dict.fromkeys(names)}
    return _model_step_variants(rows, layers, policy, chosen, HAND_WRITTEN)


PLAIN_ATTENTION = "plain attention"


def attention_variants(rows, layers=6, policy="float32"):
    """The model with attention dropout 0 on either attention path (train step and forward)."""
    attention = importlib.import_module("keras_transformer.ops.attention")
    layer = importlib.import_module("keras_transformer.layers.multi_head_attention")
    fused = (attention, "_fused", {"enabled": True})  # as set_fused_attention(True)
    variants = {
        PLAIN_ATTENTION: [(attention, "_fused", {"enabled": False})],
        # With key lengths where that applies (JAX, a GPU, 16-bit), else the mask.
        "fused attention": [fused],
        "fused attention, mask": [fused, (layer, "padded_attention", lambda *a, **k: None)],
    }
    return _model_step_variants(
        rows, layers, policy, variants, PLAIN_ATTENTION, forward=True, attention_dropout=0.0
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="+", choices=EXPERIMENTS)
    parser.add_argument("--rows", type=int, default=25000, help="tokens per side of the batch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=6, help="layers per stack")
    parser.add_argument("--policy", default="float32", help="dtype policy, e.g. mixed_bfloat16")
    parser.add_argument(
        "--variants", nargs="+", help="gradients: the variants to time besides ours (default all)"
    )
    args = parser.parse_args(argv)
    if args.rows < 20 or args.rounds < 1:
        parser.error("--rows must be at least 20 and --rounds positive")
    results = {}
    for name in args.experiments:
        if name == "gradients":
            fns, flops = gradients_variants(args.rows, args.layers, args.variants, args.policy)
        else:
            fns, flops = attention_variants(args.rows, args.layers, args.policy)
        medians = _interleaved(fns, args.rounds)
        results[name] = medians
        print(f"{name} ({args.rows} rows, median of {args.rounds} interleaved rounds):")
        width = max(map(len, medians))
        for variant, seconds in medians.items():
            rate = (
                f"  {flops / seconds / 1e9:6.1f} GFLOP/s"
                if flops and "forward" not in variant
                else ""
            )
            print(f"  {variant:{width}s} {seconds * 1e3:9.2f} ms{rate}", flush=True)
    return results


if __name__ == "__main__":
    main()
