"""ACG: optimal gradient checkpoints on arbitrary computation graphs (Feng & Huang 2021).

`dag` indexes the computation graph, `lcg` solves linear graphs (sec. 4), `division` builds the
division tree (sec. 5.1-5.3), `search` runs Algorithms 5-6 on it, `forward` cuts the computation graph
out of a `Problem` and turns checkpoints into a schedule, `solver` is the registered `acg` solver.
"""
