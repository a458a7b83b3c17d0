"""Solvers for memory-constrained schedules (torch-free): problem, simulator, solvers by name."""
