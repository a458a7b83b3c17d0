"""Implementation variants of operator nodes: data (torch-free), rules and kernels."""
