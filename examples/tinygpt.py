"""A small GPT-style character language model, the Tiny Shakespeare data pipeline and the lr
schedule (linear warm-up, cosine decay).

Shared by examples/train_tiny.py and the benchmarks so they all train the same model on the
same data under the same schedule. The corpus is bundled in examples/data/ (no download at run time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")


class CharData:
    """Character-level tokens of the corpus, 90% train / 10% validation, deterministic batches."""

    def __init__(self, path: str = DATA, block: int = 64):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        chars = sorted(set(text))
        self.vocab = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(data))
        self.train, self.val = data[:cut], data[cut:]
        self.block = block

    def batch(self, split: str, batch: int, gen: torch.Generator):
        src = self.train if split == "train" else self.val
        ix = torch.randint(len(src) - self.block - 1, (batch,), generator=gen)
        x = torch.stack([src[i : i + self.block] for i in ix])
        y = torch.stack([src[i + 1 : i + 1 + self.block] for i in ix])
        return x, y


@dataclass
class GPTConfig:
    vocab: int = 65
    block: int = 64
    d: int = 192
    layers: int = 4
    heads: int = 4


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d)
        self.proj = nn.Linear(c.d, c.d)
        self.ln2 = nn.LayerNorm(c.d)
        self.fc = nn.Linear(c.d, 4 * c.d)
        self.out = nn.Linear(4 * c.d, c.d)
        self.heads = c.heads

    def forward(self, x):
        x = x + self.attend(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def attend(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(h).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def mlp(self, h):
        """The feed-forward part (a subclass may put experts here: benchmarks/bench_moe.py)."""
        return self.out(F.gelu(self.fc(h)))


class TinyGPT(nn.Module):
    block_type = Block  # what a subclass changes to build other blocks (bench_moe.py: experts)

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.d)
        self.pos = nn.Embedding(c.block, c.d)
        self.blocks = nn.ModuleList(self.block_type(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d)
        self.head = nn.Linear(c.d, c.vocab, bias=False)
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("out.weight") or n.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


WARMUP_FRACTION = 0.1
FINAL_LR_FRACTION = 0.1
SCHEDULE = (f"linear warm-up over the first {WARMUP_FRACTION:.0%} of the steps, cosine decay to "
            f"{FINAL_LR_FRACTION:.0%} of the peak lr at the last step")


def warmup_cosine(peak: float, steps: int, warmup_fraction: float = WARMUP_FRACTION,
                  final_fraction: float = FINAL_LR_FRACTION) -> Callable[[int], float]:
    """lr of step i (0-based): linear warm-up to ``peak`` over the first warmup_fraction of the
    steps, then cosine decay to final_fraction x peak at the last step."""
    warm = max(1, round(warmup_fraction * steps))

    def lr_at(i: int) -> float:
        if i < warm:
            return peak * (i + 1) / warm
        t = (i - warm) / max(1, steps - 1 - warm)
        return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * t)))

    return lr_at
