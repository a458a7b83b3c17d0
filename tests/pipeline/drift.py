"""A loss that drifts between calls, copied into the CLI tests' project folders (`drift:drifting_loss`): the
plan captured at one call cannot reproduce eager steps at another, so validation must fail."""

import torch.nn.functional as F

CALLS = [0]


def drifting_loss(model, x, y):
    """Cross-entropy scaled by a call counter."""
    CALLS[0] += 1
    return F.cross_entropy(model(x), y) * CALLS[0]
