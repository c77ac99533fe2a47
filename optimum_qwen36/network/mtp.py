"""The multi-token-prediction layer, which drafts the tokens of MTP speculative decoding."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from .config import FULL_ATTENTION
from .layers import Qwen36DecoderLayer, Qwen36RMSNorm
from .step_inputs import StepInputs


class Qwen36MultiTokenPredictor(nn.Module):
    """Qwen3.5/3.6's multi-token-prediction layer (checkpoint keys `mtp.*`; transformers drops them).

    At position i it reads the trunk's normed hidden state h_i and the embedding of the token after it,
    x_{i+1}: `fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))`, one full-attention
    decoder layer with its own KV cache entry, then `norm`; the shared `lm_head` gives the logits of x_{i+2}.
    Its normed output stands in for h at the next position when it drafts further."""

    def __init__(self, config: PretrainedConfig, cache_idx: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen36RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = Qwen36RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.layers = nn.ModuleList([Qwen36DecoderLayer(config, FULL_ATTENTION, cache_idx)])
        self.norm = Qwen36RMSNorm(size, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        mixed = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        out = self.fc(mixed)
        for layer in self.layers:
            out = layer(out, step)
        return self.norm(out)
