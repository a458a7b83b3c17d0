"""Hierarchical planning: the chain of blocks, per-block ladders, the chain dynamic program (Rockmate)."""

from memplan.tasks.solve.hierarchical.solver import HierarchicalOptions, hierarchical

__all__ = ["HierarchicalOptions", "hierarchical"]
