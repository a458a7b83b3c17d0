"""The executor form: a plan's schedule run as a training step (arena, CUDA graph, DDP, optimizer)."""
