"""A model of repeated blocks for the device-memory tests: `depth` blocks of Linear, Tanh, Linear (`width`
wide, 4 x `width` inside), whose activations outweigh their parameters."""

from torch import nn


def blocks(width: int = 32, depth: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                           for _ in range(depth)])
