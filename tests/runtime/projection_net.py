"""A residual net whose blocks' input projection only recomputed ops read (the backward of `* 0.5` reads
nothing of it), as a query projection before rotary embeddings: the layers torchtitan's op list keeps the
matmul outputs of. Sin's backward is two ops (cos, mul) autograd runs as one Node."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.inp, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.sin(self.inp(x) * 0.5))


class Net(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
