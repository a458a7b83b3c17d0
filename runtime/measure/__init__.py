"""Measured memory and exact arithmetic for comparing steps."""
