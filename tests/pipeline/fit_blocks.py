"""A model of repeated blocks for the device-memory tests: `depth` blocks of Linear, Tanh, Linear (`width`
wide, 4 x `width` inside), whose activations outweigh their parameters."""

from torch import nn


def blocks(width: int = 32, depth: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def token_blocks(vocab: int = 64, width: int = 16, depth: int = 4) -> nn.Module:
    """Token ids -> embeddings -> `blocks`: a sequence model whose activations grow with the sequence length."""
    return nn.Sequential(nn.Embedding(vocab, width), *blocks(width, depth))
