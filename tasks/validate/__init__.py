"""Validation: the reference step, step timing, the overhead walk, the validate stage."""
