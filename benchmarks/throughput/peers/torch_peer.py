"""The torch peer: torch.nn.Transformer with the same shapes, optimizer and loss."""

from __future__ import annotations

import math

import numpy as np


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
