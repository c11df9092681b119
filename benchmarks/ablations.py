"""Small side-by-side timings behind design choices of the training step.

Each experiment builds its variants in one process and times them
interleaved, over `--rounds` rounds; it prints the median per variant.
All but `gradients` and `attention` run on the TensorFlow backend only (those choices are
about TensorFlow's CPU kernels).

    column-sum  sum over the rows of a (rows, 512) matrix: TensorFlow's
                reduce_sum, BiasAddGrad, and the product ones(1, rows) @ g
                (what keras_transformer.ops.linear.column_sum does)
    qkv         the three attention projections forward and backward:
                separate 512 x 512 products, or one fused 512 x 1536 product
                split with tf.split, or sliced from a (B, T, 3, N, H) view
    xla-matmul  a (rows, 512) x (512, 2048) product, plain and under XLA
    loss        the label-smoothed loss forward and backward over (rows,
                vocabulary) logits: keras_transformer's (a logsumexp forward,
                exp(logits - logsumexp) again in the backward pass) and one
                that keeps the fused softmax for the backward pass
    rdrop       R-Drop's consistency term (the symmetric KL between the
                two copies of each sentence) forward and backward over
                (rows, 8000) logits: keras_transformer's hand-written
                gradient, and automatic differentiation through two
                log-softmaxes
    dropout     dropout at rate 0.1 forward and backward over (rows, 512):
                keras.layers.Dropout and keras_transformer's 16-bit masks
    transpose-b the input gradients of the step's linear layers, g @ kernel.T
                for the (512, 512), (512, 2048) and (2048, 512) kernels:
                the product with TensorFlow's transpose_b flag, and with the
                transpose written out first
                (keras_transformer.ops.linear.transposed_copy)
    gradients   a whole training step (`train_on_batch`, paper-base shapes,
                one batch of ~--rows tokens per side) of the model with the
                hand-written gradients (attention projections, feed-forward
                products, layer norm, loss;
                keras_transformer.ops.hand_written_gradients), with
                each of them left to automatic differentiation, with none,
                with their column sums as plain sums, and with their input
                gradients through transpose_b; any backend (the others but
                attention are TensorFlow only)
    attention   the same model with attention dropout 0, a training step
                and a forward pass, with attention through the plain
                expression and through keras.ops.dot_product_attention
                (keras_transformer.ops.set_fused_attention); any backend

    python -m benchmarks.ablations column-sum qkv xla-matmul loss dropout transpose-b --rows 25000
    python -m benchmarks.ablations rdrop --rows 2048
    KERAS_BACKEND=jax python -m benchmarks.ablations gradients --rows 25000 --layers 2
    python -m benchmarks.ablations attention --rows 4000 --layers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

EXPERIMENTS = (
    "column-sum",
    "qkv",
    "xla-matmul",
    "loss",
    "rdrop",
    "dropout",
    "transpose-b",
    "gradients",
    "attention",
)
# The experiments that step the whole model; they run on any backend.
MODEL_EXPERIMENTS = {"gradients", "attention"}


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


def column_sum_variants(rows):
    import tensorflow as tf

    g = tf.random.normal((rows, 512))
    ones = tf.ones((1, rows))
    fns = {
        "reduce_sum": tf.function(lambda g: tf.reduce_sum(g, 0)),
        "BiasAddGrad": tf.function(lambda g: tf.raw_ops.BiasAddGrad(out_backprop=g)),
        "ones @ g": tf.function(lambda g: tf.matmul(ones, g)[0]),
    }
    reference = fns["reduce_sum"](g).numpy()
    for name, fn in fns.items():
        error = abs(fn(g).numpy() - reference).max()
        assert error < 1e-2 * max(1.0, abs(reference).max()), (name, error)
    return {name: (lambda fn=fn: fn(g).numpy()) for name, fn in fns.items()}, None


def qkv_variants(rows):
    import tensorflow as tf

    batch, length, heads, head = rows // 20, 20, 8, 64
    width = heads * head
    x = tf.Variable(tf.random.normal((batch, length, width)))
    kernels = [tf.Variable(tf.random.normal((width, width)) * 0.05) for _ in range(3)]
    biases = [tf.Variable(tf.zeros((width,))) for _ in range(3)]
    upstream = [tf.random.normal((batch, length, heads, head)) for _ in range(3)]

    def separate(rows_2d):
        return [
            tf.reshape(tf.matmul(rows_2d, k) + b, (batch, length, heads, head))
            for k, b in zip(kernels, biases, strict=True)
        ]

    def fused(rows_2d):
        y = tf.matmul(rows_2d, tf.concat(kernels, axis=1)) + tf.concat(biases, axis=0)
        return [tf.reshape(t, (batch, length, heads, head)) for t in tf.split(y, 3, axis=1)]

    def fused_sliced(rows_2d):
        y = tf.matmul(rows_2d, tf.concat(kernels, axis=1)) + tf.concat(biases, axis=0)
        y = tf.reshape(y, (batch, length, 3, heads, head))
        return [y[:, :, i] for i in range(3)]

    def step(project):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                outputs = project(tf.reshape(x, (-1, width)))
                loss = tf.add_n(
                    [tf.reduce_sum(o * u) for o, u in zip(outputs, upstream, strict=True)]
                )
            grads = tape.gradient(loss, [x, *kernels, *biases])
            return loss, grads

        return run

    fns = {
        "separate": step(separate),
        "fused, split": step(fused),
        "fused, sliced": step(fused_sliced),
    }
    losses = {name: float(fn()[0]) for name, fn in fns.items()}
    assert max(losses.values()) - min(losses.values()) <= 1e-3 * abs(losses["separate"]), losses
    flops = 3 * 3 * 2.0 * rows * width * width  # three projections, forward + backward
    return {name: (lambda fn=fn: fn()[0].numpy()) for name, fn in fns.items()}, flops


def xla_matmul_variants(rows):
    import tensorflow as tf

    a = tf.random.normal((rows, 512))
    b = tf.random.normal((512, 2048))
    plain = tf.function(lambda a, b: tf.matmul(a, b)[:1, :1])
    xla = tf.function(lambda a, b: tf.matmul(a, b)[:1, :1], jit_compile=True)
    return {
        "TensorFlow (oneDNN)": lambda: plain(a, b).numpy(),
        "XLA": lambda: xla(a, b).numpy(),
    }, 2.0 * rows * 512 * 2048


def loss_variants(rows, vocabulary=37000, smoothing=0.1):
    import numpy as np
    import tensorflow as tf

    from keras_transformer.ops import loss as loss_ops

    rng = np.random.default_rng(0)
    logits = tf.Variable(rng.standard_normal((rows // 20, 20, vocabulary), dtype="float32"))
    labels = tf.constant(rng.integers(1, vocabulary, (rows // 20, 20)), tf.int32)
    confidence = 1.0 - smoothing
    positions = loss_ops._flat_label_positions(labels, vocabulary)

    @tf.custom_gradient
    def softmax_kept_loss(z):
        probs = tf.nn.softmax(z)
        # max p >= 1/V: log-normalizer = max z - log(max p), finite however far z spreads.
        log_normalizer = tf.reduce_max(z, -1) - tf.math.log(tf.reduce_max(probs, -1))
        true_logits = loss_ops._true_logits(labels, z, positions)
        loss = log_normalizer - confidence * true_logits - smoothing * tf.reduce_mean(z, -1)

        def grad(upstream):
            gradient = (probs - smoothing / vocabulary) * upstream[..., None]
            return loss_ops._add_at_labels(gradient, labels, -confidence * upstream, positions)

        return loss, grad

    def step(losses):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(losses(logits))
            gradient = tape.gradient(loss, logits)
            return loss, gradient[:2, :2, :5]

        return run

    fns = {
        "logsumexp, exp again (ours)": step(
            lambda z: loss_ops.label_smoothed_token_losses(labels, z, smoothing)
        ),
        "softmax kept": step(softmax_kept_loss),
    }
    results = {name: fn() for name, fn in fns.items()}
    reference_loss, reference_gradient = results["logsumexp, exp again (ours)"]
    for name, (loss, gradient) in results.items():
        assert abs(float(loss) - float(reference_loss)) <= 1e-4 * abs(float(reference_loss)), name
        np.testing.assert_allclose(gradient.numpy(), reference_gradient.numpy(), atol=1e-6)
    return {name: (lambda fn=fn: fn()[0].numpy()) for name, fn in fns.items()}, None


def rdrop_variants(rows, vocabulary=8000):
    import numpy as np
    import tensorflow as tf

    from keras_transformer.ops import loss as loss_ops

    rng = np.random.default_rng(0)
    pairs = max(rows // 40, 1)  # sentences of 20 tokens, each twice
    logits = tf.Variable(rng.standard_normal((2 * pairs, 20, vocabulary), dtype="float32"))

    def step(divergence):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                value = tf.reduce_sum(divergence(logits))
            return value, tape.gradient(value, logits)

        return run

    fns = {
        "hand-written gradient (ours)": step(loss_ops._paired_symmetric_kl),
        "automatic differentiation": step(loss_ops._plain_paired_symmetric_kl),
    }
    results = {name: fn() for name, fn in fns.items()}
    reference_value, reference_gradient = results["hand-written gradient (ours)"]
    for name, (value, gradient) in results.items():
        assert abs(float(value) - float(reference_value)) <= 1e-4 * abs(float(reference_value)), (
            name
        )
        np.testing.assert_allclose(
            gradient.numpy(), reference_gradient.numpy(), atol=1e-6, err_msg=name
        )
    return {name: (lambda fn=fn: fn()[0].numpy()) for name, fn in fns.items()}, None


def dropout_variants(rows):
    import keras
    import tensorflow as tf

    from keras_transformer.layers.dropout import Dropout

    x = tf.Variable(tf.random.normal((rows // 20, 20, 512)))

    def step(layer):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                y = layer(x, training=True)
            gradient = tape.gradient(y, x, output_gradients=tf.ones_like(y))
            return tf.reduce_mean(tf.cast(y == 0, tf.float32)), gradient[0, 0, 0]

        return run

    fns = {"keras.layers.Dropout": step(keras.layers.Dropout(0.1, seed=1))}
    fns["16-bit masks (ours)"] = step(Dropout(0.1, seed=1))
    for name, fn in fns.items():
        assert abs(float(fn()[0]) - 0.1) < 0.01, name
    return {name: (lambda fn=fn: fn()[1].numpy()) for name, fn in fns.items()}, None


def transpose_b_variants(rows):
    import tensorflow as tf

    from keras_transformer.ops.linear import transposed_copy

    shapes = [(512, 512), (512, 2048), (2048, 512)]
    kernels = {shape: tf.Variable(tf.random.normal(shape)) for shape in shapes}
    upstream = {shape: tf.random.normal((rows, shape[1])) for shape in shapes}
    fns = {}
    for shape in shapes:
        label = f"{shape[0]}x{shape[1]} kernel"
        kernel, g = kernels[shape], upstream[shape]
        folded = tf.function(lambda g=g, k=kernel: tf.matmul(g, k, transpose_b=True))
        copied = tf.function(lambda g=g, k=kernel: tf.matmul(g, transposed_copy(k)))
        reference = folded()
        error = float(tf.reduce_max(tf.abs(copied() - reference)))
        assert error <= 1e-3 * float(tf.reduce_max(tf.abs(reference))), (label, error)
        fns[f"{label}, transpose_b"] = folded
        fns[f"{label}, transposed copy"] = copied
    # Only one element is fetched, so the copy to NumPy costs nothing. Per-variant
    # FLOP counts differ, so no common rate: printed as times only.
    return {name: (lambda fn=fn: fn()[:1, :1].numpy()) for name, fn in fns.items()}, None


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
    variants = {
        PLAIN_ATTENTION: [(attention, "fused_attention_enabled", lambda: False)],
        "fused attention": [(attention, "fused_attention_enabled", lambda: True)],
    }
    return _model_step_variants(
        rows, layers, policy, variants, PLAIN_ATTENTION, forward=True, attention_dropout=0.0
    )


VARIANTS = {
    "column-sum": column_sum_variants,
    "qkv": qkv_variants,
    "xla-matmul": xla_matmul_variants,
    "loss": loss_variants,
    "rdrop": rdrop_variants,
    "dropout": dropout_variants,
    "transpose-b": transpose_b_variants,
}  # "gradients" and "attention" take more arguments: called by `main` directly


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="+", choices=EXPERIMENTS)
    parser.add_argument("--rows", type=int, default=25000, help="tokens (rows) per product")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=6, help="gradients: layers per stack")
    parser.add_argument(
        "--policy", default="float32", help="gradients: dtype policy, e.g. mixed_bfloat16"
    )
    parser.add_argument(
        "--variants", nargs="+", help="gradients: the variants to time besides ours (default all)"
    )
    args = parser.parse_args(argv)
    if args.rows < 20 or args.rounds < 1:
        parser.error("--rows must be at least 20 and --rounds positive")
    import keras

    if keras.backend.backend() != "tensorflow" and set(args.experiments) - MODEL_EXPERIMENTS:
        raise SystemExit("benchmarks.ablations times TensorFlow kernels: KERAS_BACKEND=tensorflow")
    results = {}
    for name in args.experiments:
        if name == "gradients":
            fns, flops = gradients_variants(args.rows, args.layers, args.variants, args.policy)
        elif name == "attention":
            fns, flops = attention_variants(args.rows, args.layers, args.policy)
        else:
            fns, flops = VARIANTS[name](args.rows)
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
