"""The runtime's model: a small GPT-style byte-level language model, its loss and its optimizer.

Everything here is deterministic: the weights are a function of (config, seed) alone (a local
`torch.Generator`, the global RNG is never touched), and the optimizer runs the plain
single-tensor AdamW path, so a step on the same inputs gives the same bits every time.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from keel.scenario import Model as ModelConfig

VOCAB = 256  # byte-level tokens


# ----------------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `layers` pre-norm transformer blocks, a final norm and an
    (untied) head over the 256 byte values."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"model.heads ({cfg.heads}) must divide model.d_model ({cfg.d_model})")
        self.context = cfg.context
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: LongTensor[B, T] of bytes (T <= context) -> logits float[B, T, 256]."""
        T = x.shape[1]
        assert T <= self.context, f"sequence of {T} tokens exceeds the model's context {self.context}"
        h = self.tok(x) + self.pos(torch.arange(T, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """A GPT whose initial weights depend on (cfg, seed) only (nanoGPT's init: N(0, 0.02),
    residual projections scaled by 1/sqrt(2 * layers), zero biases, unit norms)."""
    with torch.device("meta"):
        model = GPT(cfg)  # no default init, so the global RNG is left alone
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(int(seed))
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("proj") else 0.02
                module.weight.normal_(0.0, std, generator=g)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
    return model


# ----------------------------------------------------------------------------- loss, optimizer

def slot_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scalar: mean over samples of (the sample's mean token cross-entropy x w[sample]).
    A NaN weight (a poisoned sample) makes the loss and every gradient NaN."""
    logits = model(x)
    B, T, V = logits.shape
    per_token = F.cross_entropy(logits.reshape(B * T, V), y.reshape(B * T), reduction="none")
    per_sample = per_token.view(B, T).mean(dim=1)
    return (per_sample * w.to(per_sample.dtype)).mean()


def build_optimizer(model: nn.Module, cfg: ModelConfig) -> torch.optim.AdamW:
    """AdamW on the plain per-tensor path (foreach and fused off: bitwise stable). Weight decay
    on matrices and embeddings only, not on biases and norms."""
    decay = [p for _, p in sorted(model.named_parameters()) if p.dim() >= 2]
    no_decay = [p for _, p in sorted(model.named_parameters()) if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, foreach=False, fused=False)


# ----------------------------------------------------------------------------- hashing

from runtime.train_state import tensor_bytes, weights_sha256  # noqa: E402,F401  (here as before)
