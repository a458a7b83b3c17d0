"""The chain of blocks of a training step (Rockmate, Zhao et al. 2023, sec. 3.1), each a small problem.

The forward graph is cut at its articulation points (Checkmate appendix B.1): a value crossing a cut
is the output of the cut node only. Values that would join far-apart parts of the chain (a mask or
position table read by every layer, a U-Net skip) are taken out of the structure analysis first: a
forward value whose forward readers span more than a quarter of the forward pass is *pinned*, computed
once and kept for the whole step (its bytes still count everywhere). The segments between cuts are
merged in order into blocks of about `block_size` forward nodes, never across a module boundary
recorded at capture (a transformer layer, a residual block). Each backward node joins the earliest
block it reads from: a backward predecessor's block, or for a forward value the last block whose forward
reads it (a block's input belongs to that block), so the gradient flows from the last block to the first.

`Block.problem` is the block alone: its forward nodes, then its backward nodes, in the default order
(local ids); values made outside the block are its inputs, and what other blocks read (or the step
returns) are its outputs. Blocks with equal `key` (structure, value bytes, op names) are the same
problem up to costs, which are averaged over the instances (`blocks_by_key`): repeated layers are
solved once.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from memplan.tasks.solve.core.checkpoints import forward_nodes
from memplan.tasks.solve.core.problem import Problem, Variant

PIN_SPAN = 0.25
"""A forward value whose readers span more than this fraction of the forward pass is pinned."""


@dataclass(frozen=True)
class Block:
    """A block of the chain: global `nodes` (forward first, `num_forward` of them, then backward) and its
    local `problem`, whose node i is `nodes[i]`."""

    nodes: np.ndarray
    num_forward: int
    problem: Problem
    key: str


@dataclass(frozen=True)
class BlockChain:
    """Blocks in forward order; `block_of[node]` is each node's block; `external[i]` the bytes made by
    later blocks and live during block i's backward: graph outputs (parameter gradients, updated
    buffers) and values a block <= i reads (the incoming gradient)."""

    blocks: tuple[Block, ...]
    block_of: np.ndarray
    external: np.ndarray


def external_bytes(problem: Problem, block_of: np.ndarray, readers: list[set[int]], k: int) -> np.ndarray:
    """`BlockChain.external`: value v made in block m is live during the backward of blocks
    r..m-1, r its first reading block (0 for a graph output)."""
    made = np.where(problem.value_producer >= 0, block_of[np.maximum(problem.value_producer, 0)], -1)
    first_reader = np.array([min(r, default=k) for r in readers], dtype=np.int64)
    needed_below = np.where(problem.is_output, 0, first_reader)
    live = (made >= 0) & (needed_below < made)
    delta = np.zeros(k + 1, dtype=np.int64)
    np.add.at(delta, needed_below[live], problem.value_bytes[live])
    np.add.at(delta, made[live], -problem.value_bytes[live])
    return np.cumsum(delta[:-1])


def pinned_values(problem: Problem) -> set[int]:
    """Forward values read across more than PIN_SPAN of the forward pass (module docstring)."""
    fwd = forward_nodes(problem)
    rank = {node: i for i, node in enumerate(fwd)}
    span = PIN_SPAN * len(fwd)
    pinned = set()
    for v in np.flatnonzero(problem.value_producer >= 0):
        p = int(problem.value_producer[v])
        if p in rank:
            readers = [rank[u] for u in problem.value_users[v] if u in rank]
            if readers and max(readers) - rank[p] > span:
                pinned.add(int(v))
    return pinned


def segments(problem: Problem, pinned: set[int]) -> list[list[int]]:
    """Forward nodes in order, cut after each articulation point of the forward graph without the
    pinned values' edges, and where the recorded module changes (`Problem.node_modules`)."""
    fwd = forward_nodes(problem)
    graph = nx.Graph()
    graph.add_nodes_from(fwd)
    for node in fwd:
        for v in problem.node_inputs[node]:
            p = int(problem.value_producer[v])
            if p >= 0 and problem.is_recomputable[p] and v not in pinned:
                graph.add_edge(p, node)
    cuts = set(nx.articulation_points(graph))
    modules = problem.node_modules
    out, current = [], []
    for node, nxt in zip(fwd, fwd[1:] + [None]):
        current.append(node)
        if node in cuts or (modules and nxt is not None and modules[node] != modules[nxt]):
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def merge(parts: list[list[int]], block_size: int, modules: tuple = ()) -> list[list[int]]:
    """Consecutive segments joined while the block stays within `block_size` forward nodes (a segment
    larger than that is a block of its own). With module boundaries (`Problem.node_modules`), only
    segments of the same module call (or both outside modules) join, so a block never straddles a
    module boundary and repeated layers become repeated blocks."""
    blocks: list[list[int]] = []
    owner = (lambda part: modules[part[0]]) if modules else (lambda part: None)  # noqa: E731
    for part in parts:
        if blocks and owner(part) == owner(blocks[-1]) and len(blocks[-1]) + len(part) <= block_size:
            blocks[-1].extend(part)
        else:
            blocks.append(list(part))
    return blocks


def block_chain(problem: Problem, block_size: int) -> BlockChain:
    """The chain of blocks of `problem` (module docstring)."""
    pinned = pinned_values(problem)
    forward_blocks = merge(segments(problem, pinned), block_size, problem.node_modules)
    k = len(forward_blocks)
    block_of = np.full(problem.num_nodes, -1, dtype=np.int64)
    for i, nodes in enumerate(forward_blocks):
        block_of[nodes] = i
    home = block_of[np.maximum(problem.value_producer, 0)].copy()     # forward value -> last forward block reading it
    for node, inputs in enumerate(problem.node_inputs):
        if block_of[node] >= 0:
            for v in inputs:
                home[v] = max(home[v], block_of[node])
    for node in problem.order.tolist():
        if block_of[node] < 0:
            sources = [home[v] if problem.is_recomputable[p] else block_of[p] for v in problem.node_inputs[node]
                       if (p := problem.value_producer[v]) >= 0 and v not in pinned]
            block_of[node] = min(sources, default=k - 1)
    backward: list[list[int]] = [[] for _ in range(k)]
    for node in problem.order.tolist():
        if not problem.is_recomputable[node]:
            backward[block_of[node]].append(node)
    readers: list[set[int]] = [set() for _ in range(problem.num_values)]
    for node, inputs in enumerate(problem.node_inputs):
        for v in inputs:
            readers[v].add(int(block_of[node]))
    blocks = tuple(_block(problem, i, forward_blocks[i], backward[i], readers) for i in range(k))
    return BlockChain(blocks, block_of, external_bytes(problem, block_of, readers, k))


def _block(problem: Problem, index: int, forward: list[int], backward: list[int], readers: list[set[int]]) -> Block:
    nodes = np.array(forward + backward, dtype=np.int64)
    local_of: dict[int, int] = {}
    for node in nodes.tolist():
        for v in (*problem.node_inputs[node], *problem.node_outputs[node]):
            local_of.setdefault(v, len(local_of))
    local_node = {int(g): i for i, g in enumerate(nodes)}
    variants, num_variant_values = _block_variants(problem, nodes, local_of,
                                                   lambda v: problem.is_output[v] or readers[v] - {index})
    values = np.fromiter(local_of, dtype=np.int64, count=len(local_of))
    producer = np.array([local_node.get(int(problem.value_producer[v]), -1) for v in values], dtype=np.int64)
    outputs = tuple(local_of[v] for v in values[:len(values) - num_variant_values].tolist()
                    if producer[local_of[v]] >= 0 and (problem.is_output[v] or readers[v] - {index}))
    names = tuple(re.sub(r"_\d+$", "", problem.node_names[n]) if problem.node_names else "" for n in nodes.tolist())
    sub = Problem(
        name=f"{problem.name}[block {index}]",
        cost=problem.cost[nodes].astype(float),
        workspace=problem.workspace[nodes].astype(np.int64),
        phase=tuple(problem.phase[n] for n in nodes.tolist()),
        node_inputs=tuple(tuple(local_of[v] for v in problem.node_inputs[n]) for n in nodes.tolist()),
        node_outputs=tuple(tuple(local_of[v] for v in problem.node_outputs[n]) for n in nodes.tolist()),
        value_bytes=problem.value_bytes[values].astype(np.int64),
        value_producer=producer,
        outputs=outputs,
        order=np.arange(len(nodes), dtype=np.int64),
        node_names=names,
        variants=variants,
        num_variant_values=num_variant_values,
        cost_unit=problem.cost_unit,
    )
    text = repr((len(forward), names, sub.node_inputs, sub.node_outputs, sub.value_bytes.tolist(),
                 producer.tolist(), outputs, sub.workspace.tolist(),
                 [[(v.name, v.inputs, v.outputs, v.workspace, v.overwrites) for v in offered] for offered in variants]))
    return Block(nodes, len(forward), sub, hashlib.sha256(text.encode()).hexdigest()[:16])


def _block_variants(problem: Problem, nodes: np.ndarray, local_of: dict[int, int],
                    exported) -> tuple[tuple[tuple[Variant, ...], ...], int]:
    """The block's implementation variants in local ids (variant-only values made in the block appended to
    `local_of`, last); a variant reading a value of another block that the block does not hold is left
    out (its partner then makes a value nobody reads, which no solver picks), and so is an in-place one
    whose overwritten input the block does not make or `exported(value)` (a block output)."""
    if not problem.variants:
        return (), 0
    base = problem.num_values - problem.num_variant_values
    made = [v for g in nodes.tolist() for x in problem.variants[g] for v in x.outputs
            if v >= base and v not in local_of]
    for v in dict.fromkeys(made):
        local_of[v] = len(local_of)
    inside = set(nodes.tolist())
    offered = tuple(tuple(Variant(x.name, x.cost, x.workspace, tuple(local_of[v] for v in x.inputs),
                                  tuple(local_of[v] for v in x.outputs),
                                  tuple((local_of[o], local_of[i]) for o, i in x.overwrites))
                          for x in problem.variants[g] if all(v in local_of for v in x.inputs)
                          and all(problem.value_producer[i] in inside and not exported(i) for _, i in x.overwrites))
                    for g in nodes.tolist())
    return (offered if any(offered) else ()), len(dict.fromkeys(made))


def blocks_by_key(chain: BlockChain) -> dict[str, tuple[Block, Problem]]:
    """One representative per distinct block key, with the instances' mean node costs."""
    groups: dict[str, list[Block]] = {}
    for block in chain.blocks:
        groups.setdefault(block.key, []).append(block)
    out = {}
    for key, members in groups.items():
        first = members[0]
        mean = np.mean([b.problem.cost for b in members], axis=0)
        out[key] = (first, replace(first.problem, cost=mean))
    return out
