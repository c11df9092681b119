"""The systems the throughput benchmark compares, behind one interface.

A peer has `name`, `parameters` (its trainable parameter count),
`prepare(batch) -> prepared` (a `benchmarks.throughput.batches` batch turned
into the peer's own tensors, once, outside the timing) and
`step(prepared) -> float` (one optimizer step; returns the loss, which also
waits for the step to finish).

    ours            this package, float32
    ours-bf16       this package under the `mixed_bfloat16` policy
    keras-hub       keras_hub.layers TransformerEncoder/TransformerDecoder
    keras-mha       a plain build on keras.layers.MultiHeadAttention (the
                    architecture of TensorFlow's Transformer tutorial)
    torch           torch.nn.Transformer (float32; autocast bfloat16 on a GPU)

Not in the default run (`--peers` names them): ours-bf16-fused (ours-bf16
without dropout on the attention weights, as in the paper, so that the
fused attention kernel can train), keras-hub-bf16 and keras-mha-bf16 (the
Keras peers under `mixed_bfloat16`).
"""

from __future__ import annotations

PEERS = ("ours", "ours-bf16", "keras-hub", "keras-mha", "torch")
EXTRA_PEERS = ("ours-bf16-fused", "keras-hub-bf16", "keras-mha-bf16")


def make_peer(name, config, args):
    """Builds peer `name` for `config`; `args` carries `mixed_precision` and `jit_compile`."""
    from benchmarks.throughput.peers.keras_peers import (
        KerasPeer,
        build_keras_hub,
        build_keras_mha,
        build_ours,
    )

    mixed = "mixed_bfloat16" if args.mixed_precision == "bfloat16" else "mixed_float16"
    if name == "ours":
        return KerasPeer(name, build_ours, config, jit_compile=args.jit_compile)
    if name == "ours-bf16":
        return KerasPeer(name, build_ours, config, policy=mixed, jit_compile=args.jit_compile)
    if name == "ours-bf16-fused":
        import dataclasses

        config = dataclasses.replace(config, attention_dropout=0.0)
        return KerasPeer(name, build_ours, config, policy=mixed, jit_compile=args.jit_compile)
    if name in ("keras-hub-bf16", "keras-mha-bf16"):
        builder = build_keras_hub if name == "keras-hub-bf16" else build_keras_mha
        return KerasPeer(name, builder, config, policy=mixed, jit_compile=args.jit_compile)
    if name == "keras-hub":
        return KerasPeer(name, build_keras_hub, config, jit_compile=args.jit_compile)
    if name == "keras-mha":
        return KerasPeer(name, build_keras_mha, config, jit_compile=args.jit_compile)
    if name == "torch":
        import torch

        from benchmarks.throughput.peers.torch_peer import TorchPeer

        autocast = args.mixed_precision if torch.cuda.is_available() else None
        return TorchPeer(config, autocast=autocast)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS + EXTRA_PEERS)}")
