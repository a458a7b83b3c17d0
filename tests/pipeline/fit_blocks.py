"""A model of repeated blocks for the device-memory tests: `depth` blocks of Linear, Tanh, Linear (`width`
wide, 4 x `width` inside), whose activations outweigh their parameters."""

from torch import nn


def blocks(width: int = 32, depth: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def token_blocks(vocab: int = 64, width: int = 16, depth: int = 4) -> nn.Module:
    """Token ids -> embeddings -> `blocks`: a sequence model whose activations grow with the sequence length."""
    return nn.Sequential(nn.Embedding(vocab, width), *blocks(width, depth))


def wide_blocks(width: int = 16, depth: int = 3, parts: int = 3) -> nn.Module:
    """`depth` blocks of `parts` sub-blocks (Linear to 16 x `width`, GELU, Linear back): a sub-block saves two
    wide tensors for its backward but takes a narrow input, so checkpointing within a block saves memory."""
    def part() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 16 * width), nn.GELU(), nn.Linear(16 * width, width))

    return nn.Sequential(*[nn.Sequential(*[part() for _ in range(parts)]) for _ in range(depth)])


def bn_convnet(channels: int = 8, depth: int = 3, classes: int = 10) -> nn.Module:
    """A stem and `depth` blocks of 3x3 convolution, BatchNorm and ReLU, then pooling and a linear classifier:
    BatchNorm in training mode rules micro-batch references out."""
    def unit(inputs: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(inputs, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())

    return nn.Sequential(unit(3), *[unit(channels) for _ in range(depth)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, classes))
