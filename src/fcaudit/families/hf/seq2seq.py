"""Encoder-decoder MoEs (Switch Transformers) audited through their decoder: the audit's windows are the decoder's
tokens, the encoder reads one given source for every window; the routers take `SwitchRoute` (codecs.py)."""

from __future__ import annotations

import torch
from torch import nn


class DecoderLM(nn.Module):
    """`model` (a transformers encoder-decoder) as a causal LM over its decoder: forward(ids) gives the decoder's
    logits for decoder_input_ids=ids, the encoder reading `encoder_ids` [S] (or [1, S]), the same for every window."""

    def __init__(self, model: nn.Module, encoder_ids: torch.Tensor):
        super().__init__()
        self.model, self.config = model, model.config
        self.register_buffer("encoder_ids", torch.as_tensor(encoder_ids).reshape(1, -1), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        source = self.encoder_ids.expand(input_ids.shape[0], -1)
        return self.model(input_ids=source, decoder_input_ids=input_ids, use_cache=False).logits
