"""Small models for the IR tests: a GPT-like decoder (fused or explicit attention, tied head), a T5-like
encoder-decoder, a conv net, and models that torch.fx alone cannot trace."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, *, math_attention: bool, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.math_attention = math_attention
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        kv = x if memory is None else memory
        q = self.q_proj(x).view(B, T, -1, C // self.heads).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(kv).view(B, kv.size(1), -1, C // self.heads).transpose(1, 2)
        v = self.v_proj(kv).view(B, kv.size(1), -1, C // self.heads).transpose(1, 2)
        causal = memory is None
        if self.math_attention:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            if causal:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, *, math_attention: bool = False, dropout: float = 0.0,
                 cross: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, math_attention=math_attention, dropout=dropout)
        self.cross = Attention(hidden, heads, math_attention=math_attention, dropout=dropout) if cross else None
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.cross is not None:
            x = x + self.cross(x, memory)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-2 style: learned positions, pre-norm blocks, head tied to the token embedding via F.linear."""

    def __init__(self, vocab: int = 96, seq: int = 16, hidden: int = 32, layers: int = 3, heads: int = 4, *,
                 math_attention: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, math_attention=math_attention, dropout=dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head, (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TinyEncoderDecoder(nn.Module):
    """T5-like: every decoder block cross-attends to the encoder output."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.enc_norm = nn.LayerNorm(hidden)
        self.decoder = nn.ModuleList(Block(hidden, heads, cross=True) for _ in range(layers))
        self.dec_norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.embed(src)
        for block in self.encoder:
            memory = block(memory)
        memory = self.enc_norm(memory)
        y = self.embed(tgt)
        for block in self.decoder:
            y = block(y, memory)
        return self.head(self.dec_norm(y))


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.conv2(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export (static shapes) can."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:
            x = self.l1(x)
        return self.l2(x).relu()


class RowLoop(nn.Module):
    """Loops over a dimension in Python: fx cannot (range(Proxy)); as a leaf module it runs fine."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [self.proj(x[i]) for i in range(x.shape[0])]
        return torch.stack(rows)


class WithRowLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.loop = RowLoop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loop(self.inp(x))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # depends on tensor values: no shape-only tracer can follow it
            return self.l(x)
        return x


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.pre(x))


class Router(nn.Module):
    """A softmax that is not attention (a router): must not be tagged attention_core."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)  # (B, T, E)
        top, idx = torch.topk(probs, 2, dim=-1)
        mixed = torch.einsum("bte,ehk->btk", probs, self.w.transpose(1, 2))
        return torch.einsum("btk,bt->btk", mixed, top.sum(-1))


def value_branch(batch: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A `package.module:factory` for the CLI tests: an untraceable model with its example input."""
    return ValueBranch(), (torch.randn(batch, 8),)
