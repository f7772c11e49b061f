"""Small models and a plain-PyTorch reference for engine equivalence tests."""

from __future__ import annotations

import torch
from torch import nn

from lightning_roundpipe.runtime import layer_seed
from lightning_roundpipe.runtime.nested import batch_size_of, call_layer, split_microbatches

VOCAB, HIDDEN, SEQ = 37, 16, 6


def mlp(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return list(
        nn.Sequential(
            nn.Linear(8, 16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.GELU(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 4),
        )
    )


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(ids) + self.pos[: ids.shape[1]])


class Block(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        # no attention bias: the key bias gets an exactly-zero gradient, and Adam would
        # amplify rounding noise in it into full-size updates of random sign
        self.attn = nn.MultiheadAttention(HIDDEN, 2, dropout=dropout, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN),
            nn.GELU(),
            nn.Linear(4 * HIDDEN, HIDDEN),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def transformer(num_blocks: int = 4, seed: int = 0, dropout: float = 0.1) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(), *[Block(dropout) for _ in range(num_blocks)], Head()]


def lm_batch(batch: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, labels


class TupleIn(nn.Module):
    """ids, float scale -> (hidden, mask, scale): tuple activations with a
    non-float member and a float member that passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor):
        mask = (ids % 3 != 0).to(torch.int64)
        return self.emb(ids) * scale[:, None, None], mask, scale


class TupleMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h, mask, scale):
        return torch.tanh(self.lin(h)) * mask[..., None] + h * scale[:, None, None], mask, scale


class ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h, mask, scale):
        return {"h": self.lin(h), "mask": mask}


class DictMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h, mask):
        return {"h": torch.relu(self.lin(h)) + h, "mask": mask}


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, h, mask):
        return self.out(h) * mask[..., None]


def structured(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [TupleIn(), TupleMid(), TupleMid(), ToDict(), DictMid(), DictHead()]


def reference(layers, inputs, labels, loss_fn, num_microbatches, *, seed=0, iteration=0, scale=1.0):
    """Plain single-device PyTorch: run each micro-batch through the layers with
    the engine's per-(iteration, layer, micro-batch) seeds, backward the weighted
    loss. Returns the summed weighted loss."""
    bsz = batch_size_of(inputs)
    xs = split_microbatches(inputs, num_microbatches, bsz)
    ys = (
        [None] * num_microbatches
        if labels is None
        else split_microbatches(labels, num_microbatches, bsz)
    )
    total = torch.zeros(())
    for j, (x, y) in enumerate(zip(xs, ys, strict=True)):
        for i, layer in enumerate(layers):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layer_seed(seed, iteration, i, j))
                x = call_layer(layer, x)
        loss = x if loss_fn is None else loss_fn(x, y)
        w = batch_size_of(split_microbatches(inputs, num_microbatches, bsz)[j]) / bsz
        (loss * w * scale).backward()
        total = total + loss.detach() * w * scale
    return total
