"""MONeT (Shah et al., ICLR 2021): checkpoints and operator implementations in one 0-1 program."""

from memplan.tasks.solve.monet.solver import MonetOptions, block_rung, monet, monet_noop

__all__ = ["MonetOptions", "block_rung", "monet", "monet_noop"]
