"""OLLA (Steiner et al. 2022): the operator order that minimizes the peak (lifetime ILP) and arena
addresses that minimize fragmentation (location ILP), solved one after the other (sec. 4.4)."""

from memplan.tasks.solve.olla.location import LocationResult, olla_addresses
from memplan.tasks.solve.olla.solver import OllaOptions, olla

__all__ = ["LocationResult", "OllaOptions", "olla", "olla_addresses"]
