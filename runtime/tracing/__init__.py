"""Capture: a training step as a joint ATen graph folded into an operator graph, with its rewrites."""
