"""Training throughput of this package next to its peers, and against the matmul peak.

Every peer is built to the same shapes (`paper-base`: 6+6 layers, d_model 512,
d_ff 2048, 8 heads, a 37000-token vocabulary; `small`: the package's preset),
trained with Adam and label-smoothed cross-entropy (0.1) on the same fixed
batches, one after another in one process per configuration (shape and
token budget), with the repetitions interleaved; the median repetition is
reported, with ratios to ours. A configuration whose process runs out of
memory is reported as such and the run goes on.

Peers (`--peers`):
    ours            this package, float32
    ours-bf16       this package under the `mixed_bfloat16` policy
    keras-hub       keras_hub.layers TransformerEncoder/TransformerDecoder
    keras-mha       a plain build on keras.layers.MultiHeadAttention (the
                    architecture of TensorFlow's Transformer tutorial)
    torch           torch.nn.Transformer (float32; autocast bfloat16 on a GPU)

The batches mimic `keras_transformer.data.make_dataset`: sentence pairs of
varied length (log-normal, median 24 tokens), grouped in the pipeline's length
buckets and padded to the bucket width, `tokens_per_batch // width` pairs per
batch. Throughput counts real (non-padding) tokens.

Model FLOPs are counted analytically (forward: every projection, the attention
scores and weighted values, the feed-forward layers and the output layer;
training = 3 x forward) on the real tokens of each batch; utilization divides
model FLOP/s by the dense float32 matmul peak measured on this machine in the
same run (the best of the backend's and torch's 4096 x 4096 matmul). On a GPU
(`KERAS_BACKEND=jax`) the peaks are ten back-to-back 8192 x 8192 products in
float32 (XLA's default precision: TF32 on recent NVIDIA GPUs) and bfloat16;
mixed-precision peers are held to the bfloat16 peak, and every row is also
given against it (`mfu_of_bfloat16_peak`); `--memory` reports the device
allocator's peak next to RSS. The peak
is measured at the start of the run and again in each configuration's process
before every round of repetitions and after the last; the highest value seen
so far is the one used, so a VM that slows down during the run does not
flatter the utilization.

    python -m benchmarks.train_throughput                      # everything
    python -m benchmarks.train_throughput --shapes small --budgets 4096
    KERAS_BACKEND=jax python -m benchmarks.train_throughput    # on a GPU machine

Prints a table and writes benchmarks/results/train_throughput-<backend>-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks.machine import describe_machine

PEERS = ("ours", "ours-bf16", "keras-hub", "keras-mha", "torch")
SHAPES = ("small", "paper-base")  # the default run
ALL_SHAPES = SHAPES + ("paper-big",)  # Transformer-big, for GPU runs
BUDGETS = (4096, 25000)
RESULTS = os.path.join(os.path.dirname(__file__), "results")


# ----------------------------------------------------------------------------
# Batches and FLOPs


def make_batches(max_length, tokens_per_batch, count, vocabulary_size, seed=0):
    """`count` padded batches of ~`tokens_per_batch` tokens per side.

    Returns a list of dicts with int32 arrays `source`, `target_in`, `labels`
    (padding id 0, BOS 1, EOS 2) and the real lengths `source_lengths`,
    `target_lengths`.
    """
    from keras_transformer.data.pipeline import bucket_boundaries

    rng = np.random.default_rng(seed)
    boundaries = bucket_boundaries(max_length)
    pairs = 20000
    source_len = np.clip(np.round(rng.lognormal(math.log(24), 0.5, pairs)), 3, max_length - 1)
    ratio = rng.lognormal(0.0, 0.15, pairs)
    target_len = np.clip(np.round(source_len * ratio), 3, max_length - 1)
    source_len, target_len = source_len.astype(int) + 1, target_len.astype(int) + 1  # EOS/BOS
    longest = np.maximum(source_len, target_len)
    width_of = np.array([next(b for b in boundaries if b >= n) for n in longest])
    # Pick the buckets of the batches as the pipeline would meet them: a batch's
    # bucket is drawn with probability proportional to the tokens it holds.
    widths, weights = np.unique(width_of, return_counts=True)
    weights = weights * widths
    chosen = rng.choice(widths, size=count, replace=False, p=weights / weights.sum())
    batches = []
    for width in sorted(chosen):
        members = np.flatnonzero(width_of == width)
        size = max(1, tokens_per_batch // width)
        picked = rng.choice(members, size=min(size, len(members)), replace=False)
        if len(picked) < size:  # a rare bucket: reuse pairs to fill the batch
            picked = rng.choice(members, size=size, replace=True)
        src = np.zeros((size, width), np.int32)
        tin = np.zeros((size, width), np.int32)
        lab = np.zeros((size, width), np.int32)
        for row, k in enumerate(picked):
            s, t = source_len[k], target_len[k]
            src[row, : s - 1] = rng.integers(3, vocabulary_size, s - 1)
            src[row, s - 1] = 2
            words = rng.integers(3, vocabulary_size, t - 1)
            tin[row, 0] = 1
            tin[row, 1:t] = words
            lab[row, : t - 1] = words
            lab[row, t - 1] = 2
        batches.append(
            {
                "source": src,
                "target_in": tin,
                "labels": lab,
                "source_lengths": source_len[picked],
                "target_lengths": target_len[picked],
            }
        )
    return batches


def training_flops(config, source_lengths, target_lengths):
    """Model FLOPs of one training step on these real lengths (3 x forward).

    A multiply-add counts 2. Attention scores and values are counted over the
    whole key range (causal or not), as every implementation computes them.
    """
    d, ff, layers, vocab = (
        config.hidden_dim,
        config.intermediate_dim,
        config.num_layers,
        config.vocabulary_size,
    )
    s = np.asarray(source_lengths, np.float64)
    t = np.asarray(target_lengths, np.float64)
    encoder = layers * (
        2 * s.sum() * 4 * d * d  # Q, K, V, output projections
        + 2 * 2 * (s * s).sum() * d  # scores and weighted values
        + 2 * s.sum() * 2 * d * ff  # feed-forward
    )
    decoder = layers * (
        2 * t.sum() * 4 * d * d  # self-attention projections
        + 2 * 2 * (t * t).sum() * d
        + 2 * t.sum() * 2 * d * d  # cross-attention Q and output
        + 2 * s.sum() * 2 * d * d  # cross-attention K and V
        + 2 * 2 * (t * s).sum() * d
        + 2 * t.sum() * 2 * d * ff
    )
    output = 2 * t.sum() * d * vocab
    return 3.0 * (encoder + decoder + output)


# ----------------------------------------------------------------------------
# Matmul peak and memory


def matmul_peak(backend, size=None, repeats=5, dtype="float32"):
    """Best dense matmul GFLOP/s of `backend` on size x size operands.

    On the CPU one 4096 x 4096 product is timed; on a GPU, where one product
    takes about a millisecond, ten 8192 x 8192 products are queued back to back
    and timed together, so the launch and synchronization overhead is spread.
    """
    gpu = _accelerated(backend)
    size = size or (8192 if gpu else 4096)
    seconds = time_product(
        backend, (size, size), (size, size), dtype=dtype, repeats=repeats, chain=10 if gpu else 1
    )
    return 2.0 * size**3 / seconds / 1e9


def time_product(
    library,
    a_shape,
    b_shape,
    transpose_a=False,
    transpose_b=False,
    dtype="float32",
    repeats=5,
    chain=1,
):
    """Best seconds of one product `a @ b` by `library` ("tensorflow", "jax", "torch").

    `a_shape` and `b_shape` are the stored shapes (leading batch dimensions
    allowed); `transpose_a`/`transpose_b` transpose the last two axes in the
    product, as the backward passes do. Operands are random normal numbers
    drawn on the device (zeros or constants can run faster than real data).
    Each timing queues `chain` products and waits for the last; the best of
    `repeats` timings, divided by `chain`, is returned, after one untimed run.
    """
    gpu = _accelerated(library)
    if library == "torch":
        import torch

        device = "cuda" if gpu else "cpu"
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(a_shape, device=device).to(torch_dtype)
        b = torch.randn(b_shape, device=device).to(torch_dtype)
        a = a.mT if transpose_a else a  # views: the product reads the stored layout
        b = b.mT if transpose_b else b

        def run():
            for _ in range(chain):
                c = a @ b
            if gpu:
                torch.cuda.synchronize()
            return c

    elif library == "tensorflow":
        import tensorflow as tf

        a = tf.cast(tf.random.normal(a_shape), dtype)
        b = tf.cast(tf.random.normal(b_shape), dtype)
        product = tf.function(
            lambda x, y: tf.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b)[
                ..., :1, :1
            ],
            autograph=False,
        )

        def run():
            for _ in range(chain):
                c = product(a, b)
            return c.numpy()

    elif library == "jax":
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.key(0))
        a = jax.random.normal(keys[0], a_shape, dtype)
        b = jax.random.normal(keys[1], b_shape, dtype)

        @jax.jit
        def product(x, y):
            x = jnp.swapaxes(x, -1, -2) if transpose_a else x
            y = jnp.swapaxes(y, -1, -2) if transpose_b else y
            return x @ y

        def run():
            for _ in range(chain):
                c = product(a, b)
            return c.block_until_ready()

    else:
        raise ValueError(f"no matmul timer for library {library!r}")
    run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / chain


def _accelerated(library):
    """Whether `library` ("torch", "jax", "tensorflow") computes on a GPU here."""
    if library == "torch":
        import torch

        return torch.cuda.is_available()
    if library == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    return False


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_memory():
    """Collects garbage and hands freed heap memory back to the OS (glibc).

    Without it, memory one peer freed stays in the process and another peer
    reuses it, so RSS would not tell the peers' needs apart.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak RSS above the RSS at entry, sampled in a thread every `interval` s."""

    def __init__(self, interval=0.01):
        self.interval = interval
        self._stop = threading.Event()

    def __enter__(self):
        release_free_memory()
        self.start_rss = self.peak = _rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def increase(self):
        return self.peak - self.start_rss


# ----------------------------------------------------------------------------
# Peers


def _keras_compile(model, config, jit_compile):
    from keras_transformer.training import LabelSmoothedCrossEntropy, transformer_optimizer

    model.compile(
        optimizer=transformer_optimizer(config.hidden_dim, warmup_steps=4000),
        loss=LabelSmoothedCrossEntropy(0.1),
        # Keras' "auto": XLA under JAX, none under TensorFlow on a CPU-only machine.
        jit_compile=True if jit_compile else "auto",
    )
    return model


def build_ours(config):
    from keras_transformer import build_transformer

    return build_transformer(config)


def build_keras_hub(config):
    import keras
    import keras_hub
    from keras import ops

    from keras_transformer.layers import PaddingMask

    source_ids = keras.Input(shape=(None,), dtype="int32", name="source_ids")
    target_ids = keras.Input(shape=(None,), dtype="int32", name="target_ids")
    source_mask = PaddingMask()(source_ids)
    target_mask = PaddingMask()(target_ids)
    embedding = keras_hub.layers.ReversibleEmbedding(
        config.vocabulary_size, config.hidden_dim, tie_weights=True
    )
    position = keras_hub.layers.SinePositionEncoding()
    scale = math.sqrt(config.hidden_dim)

    def embed(ids):
        x = keras.layers.Lambda(lambda e: e * ops.cast(scale, e.dtype))(embedding(ids))
        x = keras.layers.Add()([x, position(x)])
        return keras.layers.Dropout(config.dropout)(x)

    block = dict(
        intermediate_dim=config.intermediate_dim,
        num_heads=config.num_heads,
        dropout=config.dropout,
        activation="relu",
        layer_norm_epsilon=config.layer_norm_epsilon,
    )
    x = embed(source_ids)
    for _ in range(config.num_layers):
        x = keras_hub.layers.TransformerEncoder(**block)(x, padding_mask=source_mask)
    y = embed(target_ids)
    for _ in range(config.num_layers):
        y = keras_hub.layers.TransformerDecoder(**block)(
            y,
            encoder_sequence=x,
            decoder_padding_mask=target_mask,
            encoder_padding_mask=source_mask,
        )
    logits = keras.layers.Activation("linear", dtype="float32")(embedding(y, reverse=True))
    return keras.Model({"source_ids": source_ids, "target_ids": target_ids}, logits)


def build_keras_mha(config):
    """TensorFlow's Transformer tutorial architecture on keras.layers.MultiHeadAttention.

    Post-norm residual blocks (MHA + Add + LayerNorm, FFN + Add + LayerNorm),
    scaled embeddings plus the sinusoid table, separate source/target
    embeddings and an untied output Dense, as in the tutorial; the per-head
    key size is d_model / heads, as in the paper, so the shapes match.
    """
    import keras
    from keras import ops

    from keras_transformer.layers import PaddingMask
    from keras_transformer.layers.positional_embedding import sinusoid_table

    d, heads = config.hidden_dim, config.num_heads
    table = sinusoid_table(config.max_length, d)

    class TableAdd(keras.layers.Layer):
        def call(self, x):
            positions = ops.convert_to_tensor(table[None], self.compute_dtype)
            return x * ops.cast(math.sqrt(d), x.dtype) + positions[:, : ops.shape(x)[1]]

        def compute_output_shape(self, input_shape):  # JAX cannot infer it from `call`
            return input_shape

    source_ids = keras.Input(shape=(None,), dtype="int32", name="source_ids")
    target_ids = keras.Input(shape=(None,), dtype="int32", name="target_ids")
    source_mask = PaddingMask()(source_ids)
    target_mask = PaddingMask()(target_ids)

    def embed(ids):
        x = keras.layers.Embedding(config.vocabulary_size, d)(ids)
        return keras.layers.Dropout(config.dropout)(TableAdd()(x))

    def attention(x, context, query_mask, key_mask, causal):
        mha = keras.layers.MultiHeadAttention(heads, d // heads, dropout=config.dropout)
        out = mha(x, context, query_mask=query_mask, value_mask=key_mask, use_causal_mask=causal)
        return keras.layers.LayerNormalization(epsilon=config.layer_norm_epsilon)(
            keras.layers.Add()([x, out])
        )

    def feed_forward(x):
        h = keras.layers.Dense(config.intermediate_dim, activation="relu")(x)
        h = keras.layers.Dropout(config.dropout)(keras.layers.Dense(d)(h))
        return keras.layers.LayerNormalization(epsilon=config.layer_norm_epsilon)(
            keras.layers.Add()([x, h])
        )

    x = embed(source_ids)
    for _ in range(config.num_layers):
        x = feed_forward(attention(x, x, source_mask, source_mask, False))
    y = embed(target_ids)
    for _ in range(config.num_layers):
        y = attention(y, y, target_mask, target_mask, True)
        y = feed_forward(attention(y, x, target_mask, source_mask, False))
    logits = keras.layers.Dense(config.vocabulary_size, dtype="float32")(y)
    return keras.Model({"source_ids": source_ids, "target_ids": target_ids}, logits)


class KerasPeer:
    def __init__(self, name, builder, config, policy="float32", jit_compile=False):
        import keras

        self.name = name
        previous = keras.mixed_precision.global_policy().name
        keras.mixed_precision.set_global_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            self.model = _keras_compile(builder(config), config, jit_compile)
        finally:
            keras.mixed_precision.set_global_policy(previous)
        self.parameters = self.model.count_params()

    def prepare(self, batch):
        from keras import ops

        x = {
            "source_ids": ops.convert_to_tensor(batch["source"]),
            "target_ids": ops.convert_to_tensor(batch["target_in"]),
        }
        return x, ops.convert_to_tensor(batch["labels"])

    def step(self, prepared):
        x, y = prepared
        return float(self.model.train_on_batch(x, y))


class TorchPeer:
    """torch.nn.Transformer with tied sinusoid-position embeddings, post-norm."""

    def __init__(self, config, autocast=None):
        import torch
        from torch import nn

        from keras_transformer.layers.positional_embedding import sinusoid_table

        self.name = "torch"
        torch.manual_seed(0)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.autocast = autocast
        self.config = config
        d = config.hidden_dim

        class Seq2Seq(nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = nn.Embedding(config.vocabulary_size, d, padding_idx=0)
                nn.init.normal_(self.embedding.weight, std=d**-0.5)
                self.register_buffer(
                    "table", torch.from_numpy(sinusoid_table(config.max_length, d))
                )
                self.dropout = nn.Dropout(config.dropout)
                self.transformer = nn.Transformer(
                    d_model=d,
                    nhead=config.num_heads,
                    num_encoder_layers=config.num_layers,
                    num_decoder_layers=config.num_layers,
                    dim_feedforward=config.intermediate_dim,
                    dropout=config.dropout,
                    layer_norm_eps=config.layer_norm_epsilon,
                    batch_first=True,
                )

            def embed(self, ids):
                x = self.embedding(ids) * math.sqrt(d) + self.table[: ids.shape[1]]
                return self.dropout(x)

            def forward(self, source, target):
                causal = nn.Transformer.generate_square_subsequent_mask(
                    target.shape[1], device=target.device
                )
                source_pad, target_pad = source == 0, target == 0
                hidden = self.transformer(
                    self.embed(source),
                    self.embed(target),
                    tgt_mask=causal,
                    src_key_padding_mask=source_pad,
                    tgt_key_padding_mask=target_pad,
                    memory_key_padding_mask=source_pad,
                    tgt_is_causal=True,
                )
                return hidden @ self.embedding.weight.t()

        self.model = Seq2Seq().to(self.device).train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        warmup = 4000
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: d**-0.5 * min((step + 1) ** -0.5, (step + 1) * warmup**-1.5),
        )

    def prepare(self, batch):
        import torch

        return tuple(
            torch.from_numpy(batch[k].astype(np.int64)).to(self.device)
            for k in ("source", "target_in", "labels")
        )

    def step(self, prepared):
        import torch
        import torch.nn.functional as F

        source, target, labels = prepared
        self.optimizer.zero_grad(set_to_none=True)
        if self.autocast:
            context = torch.autocast(self.device, dtype=getattr(torch, self.autocast))
        else:
            context = torch.autocast(self.device, enabled=False)
        with context:
            logits = self.model(source, target)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=0,
            label_smoothing=0.1,
        )
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        value = float(loss.detach())  # waits for the step
        return value


def make_peer(name, config, args):
    mixed = "mixed_bfloat16" if args.mixed_precision == "bfloat16" else "mixed_float16"
    if name == "ours":
        return KerasPeer(name, build_ours, config, jit_compile=args.jit_compile)
    if name == "ours-bf16":
        return KerasPeer(name, build_ours, config, policy=mixed, jit_compile=args.jit_compile)
    if name == "keras-hub":
        return KerasPeer(name, build_keras_hub, config, jit_compile=args.jit_compile)
    if name == "keras-mha":
        return KerasPeer(name, build_keras_mha, config, jit_compile=args.jit_compile)
    if name == "torch":
        import torch

        autocast = args.mixed_precision if torch.cuda.is_available() else None
        return TorchPeer(config, autocast=autocast)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


# ----------------------------------------------------------------------------
# The run


def _precision(name, args):
    """The matmul peak a peer is held to: on a GPU the mixed-precision peers are
    held to the peak of their 16-bit type (`--mixed-precision`), else float32."""
    mixed = name == "ours-bf16" or (name == "torch" and args.device != "cpu")
    if mixed and args.device != "cpu":
        return args.mixed_precision
    return "float32"


def _setup(config_name, budget, args):
    from keras_transformer import TransformerConfig

    overrides = {"vocabulary_size": 37000} if config_name.startswith("paper") else {}
    config = TransformerConfig.from_preset(config_name, **overrides)
    return config, make_batches(config.max_length, budget, args.batches, config.vocabulary_size)


def memory_probe(config_name, budget, name, args):
    """In a fresh process: RSS with the frameworks loaded, then the peak over training steps.

    Prints one JSON line. Peers that share a process also share freed memory,
    so their peaks can only be told apart one process each.
    """
    import resource

    import keras

    config, batches = _setup(config_name, budget, args)
    keras.ops.convert_to_numpy(keras.ops.ones((2, 2)) @ keras.ops.ones((2, 2)))
    if name == "torch":
        import torch

        (torch.ones(2, 2) @ torch.ones(2, 2)).sum().item()
    baseline = _rss_bytes()
    peer = make_peer(name, config, args)
    prepared = [peer.prepare(b) for b in batches]
    for _ in range(2):
        for item in prepared:
            peer.step(item)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {
        "shape": config_name,
        "tokens_per_batch": budget,
        "peer": name,
        "peak_rss_gib": peak / 2**30,
        "framework_rss_gib": baseline / 2**30,
        "peak_above_framework_gib": (peak - baseline) / 2**30,
    }
    if args.device != "cpu":  # the allocators' peak bytes in use on the GPU
        if name == "torch":
            import torch

            device_peak = torch.cuda.max_memory_allocated()
        else:
            import jax

            device_peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
        row["device_peak_gib"] = device_peak / 2**30
    print(json.dumps(row))


def measure_memory(args, save):
    """Runs `memory_probe` in a subprocess for every configuration and peer.

    `save(rows)` is called after every probe, so a long run keeps what it measured.
    """
    rows = []
    for shape in args.shapes:
        for budget in args.budgets:
            for name in args.peers:
                command = [sys.executable, "-m", "benchmarks.train_throughput", "--memory-probe"]
                command += [name, "--shapes", shape, "--budgets", str(budget)]
                command += ["--batches", str(args.batches)]
                command += ["--mixed-precision", args.mixed_precision]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    if done.returncode == -9:
                        reason = "killed by SIGKILL (out of memory: see dmesg)"
                    else:
                        lines = done.stderr.strip().splitlines()
                        reason = lines[-1] if lines else f"exit status {done.returncode}"
                    rows.append(
                        {"shape": shape, "tokens_per_batch": budget, "peer": name, "error": reason}
                    )
                    print(f"  {shape:<11}{budget:>6} {name:<10} failed: {reason}", flush=True)
                    save(rows)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                device = (
                    f", device peak {row['device_peak_gib']:.2f} GiB"
                    if "device_peak_gib" in row
                    else ""
                )
                print(
                    f"  {shape:<11}{budget:>6} {name:<10} peak RSS {row['peak_rss_gib']:.2f} GiB "
                    f"({row['peak_above_framework_gib']:.2f} GiB above the loaded framework)"
                    f"{device}",
                    flush=True,
                )
                save(rows)
    return rows


def benchmark(config_name, budget, peers, args, peak_gflops):
    """Runs `peers` on one configuration; `peak_gflops` maps precision -> matmul peak."""
    config, batches = _setup(config_name, budget, args)
    real_target = int(sum(b["target_lengths"].sum() for b in batches))
    real_source = int(sum(b["source_lengths"].sum() for b in batches))
    padded = int(sum(b["source"].size for b in batches))
    flops = sum(training_flops(config, b["source_lengths"], b["target_lengths"]) for b in batches)
    print(
        f"\n{config_name}, ~{budget} tokens per batch: {len(batches)} batches "
        f"{[b['source'].shape for b in batches]}, {real_source} source + {real_target} "
        f"target real tokens ({1 - real_target / padded:.0%} of the target positions "
        f"are padding), {flops / 1e12:.2f} TFLOP per pass",
        flush=True,
    )
    built = {}
    for name in list(peers):
        with PeakMemory() as memory:
            start = time.perf_counter()
            try:
                peer = make_peer(name, config, args)
            except ImportError as error:  # e.g. no torch or keras-hub on this machine
                print(f"  {name}: skipped ({error}); pip install '.[bench]' installs the peers")
                peers = [p for p in peers if p != name]
                continue
            prepared = [peer.prepare(b) for b in batches]
            for item in prepared:  # warm-up: traces and compiles every shape
                peer.step(item)
            warm = time.perf_counter() - start
        release_free_memory()
        built[name] = {
            "peer": peer,
            "prepared": prepared,
            "warmup_seconds": warm,
            # What the peer keeps (weights, optimizer state, compiled steps).
            "resident": _rss_bytes() - memory.start_rss,
            "step_memory": [],
            "times": [],
            "cpu": [],
            "losses": [],
        }
        print(f"  {name}: built and warmed up in {warm:.1f} s", flush=True)
    # The matmul peak again, in this process, before every round of repetitions:
    # a VM's speed drifts, and utilization is taken against the highest peak
    # seen in the run (the parent's measurement included), never a lower one.
    peaks_seen = {precision: [value] for precision, value in peak_gflops.items()}

    def measure_peak_here():
        for precision, value in best_peaks(
            library_peaks(peers, args.device, 3, args.mixed_precision)
        ).items():
            peaks_seen.setdefault(precision, []).append(value)
        print(
            "  matmul peak now: "
            + ", ".join(f"{k} {v[-1]:.0f} GFLOP/s" for k, v in peaks_seen.items()),
            flush=True,
        )

    for repeat in range(args.repeats):
        measure_peak_here()
        for name in peers:  # interleaved
            entry = built[name]
            with PeakMemory() as memory:
                cpu = time.process_time()
                start = time.perf_counter()
                losses = [entry["peer"].step(item) for item in entry["prepared"]]
                elapsed = time.perf_counter() - start
                cpu = time.process_time() - cpu
            entry["step_memory"].append(memory.increase)
            entry["times"].append(elapsed)
            entry["cpu"].append(cpu)
            entry["losses"].append(losses)
            print(f"  repeat {repeat + 1} {name}: {elapsed:.2f} s ({cpu:.1f} s CPU)", flush=True)
    measure_peak_here()
    peak_used = {precision: max(values) for precision, values in peaks_seen.items()}
    rows = []
    for name in peers:
        entry = built[name]
        median = statistics.median(entry["times"])
        precision = _precision(name, args)
        rows.append(
            {
                "shape": config_name,
                "tokens_per_batch": budget,
                "peer": name,
                "parameters": int(entry["peer"].parameters),
                "median_seconds": median,
                "seconds": entry["times"],
                "cpu_seconds": entry["cpu"],
                "target_tokens_per_second": real_target / median,
                "tokens_per_second": (real_source + real_target) / median,
                "model_tflops_per_second": flops / median / 1e12,
                "mfu": flops / median / 1e9 / peak_used[precision],
                # On a GPU every peer is also held to the dense bfloat16 peak.
                "mfu_of_bfloat16_peak": (
                    flops / median / 1e9 / peak_used["bfloat16"]
                    if "bfloat16" in peak_used
                    else None
                ),
                "peak_precision": precision,
                "peak_gflops": peak_used[precision],
                "peaks_measured_gflops": peaks_seen[precision],
                # In-process RSS figures, for the record: peers in one process
                # reuse each other's freed memory, so `--memory` (one process
                # per peer) is what tells their needs apart.
                "resident_gib": entry["resident"] / 2**30,
                "step_rss_increase_gib": [m / 2**30 for m in entry["step_memory"]],
                "warmup_seconds": entry["warmup_seconds"],
                "first_loss": entry["losses"][0][0],
                "batches": [list(b["source"].shape) for b in batches],
                "real_source_tokens": real_source,
                "real_target_tokens": real_target,
                "padded_tokens_per_side": padded,
                "model_tflop_per_pass": flops / 1e12,
            }
        )
    built.clear()
    import keras

    keras.backend.clear_session()
    release_free_memory()
    for key, ours in (("ours_speedup", "ours"), ("ours_bf16_speedup", "ours-bf16")):
        base = next((r for r in rows if r["peer"] == ours), None)
        for row in rows:  # > 1: ours is faster than this peer
            row[key] = (
                base["target_tokens_per_second"] / row["target_tokens_per_second"] if base else None
            )
    return rows


ROWS_MARKER = "train_throughput rows: "


def run_configuration(shape, budget, args, peak):
    """`benchmark` for one configuration, in a child process; returns its rows.

    All peers of a configuration still share that one process (built one
    after another, repetitions interleaved). A configuration that needs more
    memory than the machine has is then killed alone: its row says so and the
    run goes on with the next configuration.
    """
    command = [sys.executable, "-u", "-m", "benchmarks.train_throughput"]
    command += ["--configuration-child", json.dumps(peak)]
    command += ["--shapes", shape, "--budgets", str(budget), "--peers", *args.peers]
    command += ["--batches", str(args.batches), "--repeats", str(args.repeats)]
    command += ["--mixed-precision", args.mixed_precision]
    command += ["--jit-compile"] if args.jit_compile else []
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    rows = None
    for line in child.stdout:
        if line.startswith(ROWS_MARKER):
            rows = json.loads(line[len(ROWS_MARKER) :])
        else:
            print(line, end="", flush=True)
    status = child.wait()
    if status == 0 and rows is not None:
        return rows
    if status == -9:
        reason = (
            "killed by SIGKILL, most likely out of memory (see dmesg): the peers of a "
            "configuration share one process; `--memory` measures each peer alone"
        )
    else:
        reason = f"failed with exit status {status} (its error is printed above)"
    print(f"\n{shape}, ~{budget} tokens per batch: {reason}", flush=True)
    return [
        {"shape": shape, "tokens_per_batch": budget, "peers": list(args.peers), "error": reason}
    ]


def print_table(rows):
    print(
        "\nMFU: model FLOP/s over the highest dense matmul rate of its precision "
        "measured in the run up to the end of that configuration ('peak', GFLOP/s)"
    )
    bf16 = any(r.get("mfu_of_bfloat16_peak") for r in rows)
    header = (
        f"{'shape':<11}{'tok/batch':>10} {'peer':<10}{'tgt tok/s':>11}{'all tok/s':>11}"
        f"{'TFLOP/s':>9}{'peak':>7}{'MFU':>7}"
        + (f"{'MFU/bf16':>9}" if bf16 else "")
        + f"{'ours/peer':>11}{'bf16/peer':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<11}{r['tokens_per_batch']:>10} (all)      {r['error']}")
            continue
        ratios = [
            f"{r[key]:.2f}x" if r.get(key) else "-" for key in ("ours_speedup", "ours_bf16_speedup")
        ]
        print(
            f"{r['shape']:<11}{r['tokens_per_batch']:>10} {r['peer']:<10}"
            f"{r['target_tokens_per_second']:>11.0f}{r['tokens_per_second']:>11.0f}"
            f"{r['model_tflops_per_second']:>9.3f}{r['peak_gflops']:>7.0f}{r['mfu']:>7.1%}"
            + (f"{r.get('mfu_of_bfloat16_peak') or 0:>9.1%}" if bf16 else "")
            + f"{ratios[0]:>11}{ratios[1]:>11}"
        )


def _device():
    """ "cpu", or the platform of the JAX backend's first device ("gpu")."""
    import keras

    if keras.backend.backend() != "jax":
        return "cpu"
    import jax

    return jax.devices()[0].platform


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=ALL_SHAPES)
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--batches", type=int, default=2, help="distinct batches per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mixed-precision", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile Keras peers with XLA under TensorFlow too (JAX always compiles)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="measure peak RSS instead, each peer in a process of its own",
    )
    parser.add_argument("--memory-probe", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--configuration-child", help=argparse.SUPPRESS)
    parser.add_argument("--peak-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # On a GPU, JAX would otherwise take 75% of the device memory at start-up,
    # leaving torch (a peer in the same process) the rest, and hiding each
    # peer's real need. Set before any child imports JAX.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.memory_probe:
        args.device = _device()
        return memory_probe(args.shapes[0], args.budgets[0], args.memory_probe, args)
    if args.configuration_child:
        args.device = _device()
        peak = json.loads(args.configuration_child)
        rows = benchmark(args.shapes[0], args.budgets[0], args.peers, args, peak)
        print(ROWS_MARKER + json.dumps(rows), flush=True)
        return
    if args.peak_child:
        print(ROWS_MARKER + json.dumps(measure_peaks(args)), flush=True)
        return

    command = "python -m benchmarks.train_throughput " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.memory:  # no matmul peak needed: each probe is a process of its own
        import keras

        out = args.out or os.path.join(
            RESULTS, f"train_memory-{keras.backend.backend()}-{_device()}.json"
        )
        machine = describe_machine()
        measure_memory(
            args,
            lambda rows: _write_json(out, {"command": command, "machine": machine, "rows": rows}),
        )
        print(f"wrote {out}")
        return

    # This process imports no framework: the children get the whole machine
    # (and, on a GPU, the whole device memory).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.train_throughput",
            "--peak-child",
            "--peers",
            *args.peers,
            "--mixed-precision",
            args.mixed_precision,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    reply = [line for line in done.stdout.splitlines() if line.startswith(ROWS_MARKER)]
    if done.returncode or not reply:
        sys.exit(f"error: measuring the matmul peak failed (exit status {done.returncode})")
    measured = json.loads(reply[-1][len(ROWS_MARKER) :])
    peaks, peak = measured["peaks"], measured["peak"]
    args.device = measured["device"]
    out = args.out or os.path.join(
        RESULTS, f"train_throughput-{measured['backend']}-{measured['device']}.json"
    )
    print("matmul GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), flush=True)
    rows = []
    for shape in args.shapes:
        for budget in args.budgets:
            new_rows = run_configuration(shape, budget, args, peak)
            rows.extend(new_rows)
            for row in new_rows:  # the next configuration starts from the highest peak
                if "peak_gflops" in row:
                    precision = row["peak_precision"]
                    peak[precision] = max(peak[precision], row["peak_gflops"])
            print_table(rows)
            _write_json(  # after every configuration, so a long run keeps what it measured
                out,
                {
                    "command": command,
                    "machine": measured["machine"],
                    "matmul_peak_gflops": peaks,
                    "highest_peak_gflops": peak,  # the highest seen so far in the run
                    "settings": vars(args),
                    "rows": rows,
                },
            )
            print(f"wrote {out}", flush=True)


def measure_peaks(args):
    """The dense matmul peaks of the backend (and torch), measured in this process."""
    import keras

    backend = keras.backend.backend()
    device = _device()
    machine = describe_machine()
    if device != "cpu":
        import jax

        gpu = jax.devices()[0]
        machine["device"] = gpu.device_kind
        machine["jax"] = jax.__version__
        # What JAX may allocate (75% of the device memory by default).
        machine["jax_memory_limit_gib"] = round(
            (gpu.memory_stats() or {}).get("bytes_limit", 0) / 2**30, 1
        )
        # None means XLA's default, which on NVIDIA GPUs since Ampere runs
        # float32 matmuls on the tensor cores in TF32: the float32 peak
        # and the float32 peers alike.
        machine["jax_default_matmul_precision"] = jax.config.jax_default_matmul_precision
        if "torch" in args.peers:
            try:
                import torch

                machine["torch"] = torch.__version__
            except ImportError:
                pass
    else:
        machine["device"] = device
    peaks = library_peaks(args.peers, device, mixed=args.mixed_precision)
    return {
        "backend": backend,
        "device": device,
        "machine": machine,
        "peaks": peaks,
        "peak": best_peaks(peaks),
    }


def library_peaks(peers, device, repeats=5, mixed="bfloat16"):
    """Dense matmul GFLOP/s of the backend (and of torch when it is a peer), by
    "<library>-<precision>"; on a GPU also bfloat16 (every row is given against
    it) and `mixed`, the type mixed-precision peers are held to."""
    import keras

    libraries = [keras.backend.backend()]
    if "torch" in peers:
        try:
            import torch  # noqa: F401

            libraries.append("torch")
        except ImportError:
            pass
    precisions = ["float32"] + (sorted({"bfloat16", mixed}) if device != "cpu" else [])
    return {
        f"{library}-{precision}": matmul_peak(library, repeats=repeats, dtype=precision)
        for precision in precisions
        for library in libraries
    }


def best_peaks(peaks):
    """precision -> the best of the libraries' peaks."""
    best = {}
    for key, value in peaks.items():
        precision = key.rsplit("-", 1)[1]
        best[precision] = max(best.get(precision, 0.0), value)
    return best


def _write_json(path, payload):
    """Writes `path` atomically (temp file, then rename), without importing the package."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


if __name__ == "__main__":
    main()
