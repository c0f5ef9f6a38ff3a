"""A compact Llama-style decoder over PACKED tokens: the model half of packed training tests.

Every token is one row: ``tokens (total,)``, ``position_ids (total,)`` and a descriptor (`Varlen`
or `Tree`) that says which rows see which. RoPE is taken at ``position_ids`` (not at the row
index), so tree-packed rows get the position they have in their own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import packattn


@dataclass
class DecoderConfig:
    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    head_dim: int | None = None  # default dim // heads_q
    mlp_hidden: int | None = None  # default ~8/3 * dim rounded up to a multiple of 16 (SwiGLU)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.heads_q % self.heads_kv != 0:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        if self.head_dim is None:
            self.head_dim = self.dim // self.heads_q
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mlp_hidden is None:
            self.mlp_hidden = -(-(8 * self.dim // 3) // 16) * 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (total, 1, head_dim) at each row's position (rotate-half layout, float32).
    Equal to gathering rows of the usual ``outer(arange(max_len), inv_freq)`` table at ``position_ids``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)[:, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.heads_q, self.heads_kv, self.head_dim = c.heads_q, c.heads_kv, c.head_dim
        self.wq = nn.Linear(c.dim, c.heads_q * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.heads_kv * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.heads_kv * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads_q * c.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin, descriptor, backend: str):
        total = x.shape[0]
        q = apply_rope(self.wq(x).view(total, self.heads_q, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(total, self.heads_kv, self.head_dim), cos, sin)
        v = self.wv(x).view(total, self.heads_kv, self.head_dim)
        out = packattn.attention(q, k, v, descriptor, causal=True, backend=backend)
        return self.wo(out.reshape(total, self.heads_q * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.mlp_hidden, bias=False)
        self.up = nn.Linear(c.dim, c.mlp_hidden, bias=False)
        self.down = nn.Linear(c.mlp_hidden, c.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim, c.norm_eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.dim, c.norm_eps), MLP(c)

    def forward(self, x, cos, sin, descriptor, backend: str):
        x = x + self.attn(self.attn_norm(x), cos, sin, descriptor, backend)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Llama-style decoder: embedding, ``num_layers`` x (RMSNorm, GQA attention with RoPE, RMSNorm,
    SwiGLU MLP), final RMSNorm, LM head. ``forward`` returns float32 logits (total, vocab)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, descriptor, *, backend: str = "auto"):
        c = self.config
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, descriptor, backend)
        return self.lm_head(self.norm(x)).float()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once
