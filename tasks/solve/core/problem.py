"""The rematerialization problem every solver sees: numbers and integer ids, no torch.

A `Problem` is an operator graph (nodes reading and allocating values) plus a compute cost and a
workspace per node, and per node its implementation variants (`Variant`: another cost, workspace and
set of values read and allocated; MONeT's operator implementations). It is built from the project's
operator graph, its variants (`runtime.variants.offered`) and its profiled costs (`Problem.from_graph`) or from
the node-link JSON of the public benchmarks (`Problem.from_node_link`). Memory is defined by
`tasks.solve.core.simulator.simulate`, never here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from memplan.runtime.policy.form import held_reads
from memplan.runtime.variants.offered import DEFAULT

PHASES = ("forward", "loss", "backward")


class ProblemError(ValueError):
    """A graph or cost table that cannot be turned into a consistent `Problem`."""


@dataclass(frozen=True)
class Variant:
    """One implementation of a node: compute cost, workspace bytes, values read and values allocated.
    `overwrites`: pairs (output, input) of an in-place implementation, the output written into the input's
    storage (it allocates nothing; the input's copy ends as the step starts, `tasks.solve.core.simulator`).
    A node's default variant is its entry in the problem's per-node arrays."""

    name: str
    cost: float
    workspace: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    overwrites: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ParamUpdate:
    """The optimizer inside the step updates one parameter tensor, graph input values `params` (one per name
    the model holds it under: tied weights), from the sum of gradient values `grads` (made by nodes, not graph
    outputs: they die at the update), with `workspace` bytes of temporaries while it runs, `carried` of which
    it still holds while the next parameter of the same optimizer step is updated (torch.optim's single-tensor
    loop keeps its last temporary until the next parameter's replaces it) (`tasks.solve.core.optimizer`; the
    simulator charges them). A parameter updated in slices (`runtime.format.schedule.update_slices`), each by an
    optimizer call of its own (after the parameters before it, whose temporaries are then freed), holds
    `sliced_workspace` bytes of temporaries while its largest slice is updated (its `workspace` and `carried`
    are 0; 0 when it is updated whole)."""

    grads: tuple[int, ...]
    params: tuple[int, ...]
    workspace: int = 0
    carried: int = 0
    sliced_workspace: int = 0

    @property
    def largest_workspace(self) -> int:
        """The most temporaries the update holds by itself."""
        return max(self.workspace, self.sliced_workspace)


@dataclass(frozen=True)
class GradientSync:
    """DistributedDataParallel all-reduces gradient values `grads` (graph outputs, in output order) in buckets of
    at most `cap_bytes`, each a flat buffer live from its launch to the end of the step
    (`tasks.solve.core.ddp`; the simulator charges the buffers)."""

    grads: tuple[int, ...]
    cap_bytes: int


@dataclass(frozen=True, eq=False)
class Problem:
    """Nodes `0..n-1` and values `0..V-1`, ids as in the source graph.

    `cost[i]`, `workspace[i]`: compute cost (graph's cost unit) and scratch bytes of node i while it runs.
    `node_inputs[i]` / `node_outputs[i]`: value ids read / allocated by node i.
    `value_bytes[v]`; `value_producer[v]` is the node allocating v, -1 for a graph input (batch,
    parameter, buffer: always resident, counted in `constant_bytes`, never in a peak).
    `outputs`: graph output values, resident from their last computation to the end.
    `order`: the default (eager) execution order, a topological order of the nodes.
    `fingerprint`: of the operator graph this problem came from, None for benchmark graphs.
    `variants[i]`: node i's non-default implementation variants (empty: none anywhere). The last
    `num_variant_values` values are allocated only by variants (e.g. a mask); a schedule of default
    steps never allocates them. `cost_unit` is "ms" when costs are profiled milliseconds.
    `random_nodes`: nodes drawing from a random generator. The runtime replays the generator only for
    recomputations, so a solver that reorders nodes (OLLA) keeps these in their default relative order.
    `node_modules[i]`: the repeated module (a transformer layer, a residual block) whose forward
    computed node i, recorded at capture (`runtime.tracing.modules`); None outside them; empty: not recorded.
    `node_parts[i]`: the child of that module (a layer's attention, MLP) whose forward computed node i;
    None outside one; empty: not recorded.
    `autograd_nodes[i]`: a number shared by the consecutive backward nodes one autograd Node runs (the
    policy form's eager capture, runtime/tracing/autograd_nodes.py; `node_inputs` already hold a Node's reads to its
    last op); None elsewhere; empty: not recorded.
    `updates`: with the optimizer inside the step, one `ParamUpdate` per parameter it updates (empty: the
    optimizer runs after the step); `optimizer_state_bytes` its resident state, reported like `constant_bytes`;
    `foreach_updates`: the updates after one step run as one foreach step, all their temporaries at once (else
    one parameter after another).
    `gradient_sync`: under DistributedDataParallel, the gradients all-reduced in buckets (None: not DDP).
    `policy_dispatch`: (forward, recomputation) cost selective checkpointing's dispatch adds per forward node of
    a region run with a policy (the policy form, runtime/policy/dispatch_cost.py); (0, 0) when not profiled.
    """

    name: str
    cost: np.ndarray
    workspace: np.ndarray
    phase: tuple[str, ...]
    node_inputs: tuple[tuple[int, ...], ...]
    node_outputs: tuple[tuple[int, ...], ...]
    value_bytes: np.ndarray
    value_producer: np.ndarray
    outputs: tuple[int, ...]
    order: np.ndarray
    fingerprint: str | None = None
    node_names: tuple[str, ...] = ()
    variants: tuple[tuple[Variant, ...], ...] = ()
    num_variant_values: int = 0
    cost_unit: str | None = None
    random_nodes: tuple[int, ...] = ()
    node_modules: tuple[str | None, ...] = ()
    node_parts: tuple[str | None, ...] = ()
    autograd_nodes: tuple[int | None, ...] = ()
    updates: tuple[ParamUpdate, ...] = ()
    optimizer_state_bytes: int = 0
    foreach_updates: bool = False
    gradient_sync: GradientSync | None = None
    policy_dispatch: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        _check(self)

    # -- implementation variants -----------------------------------------------------------------

    @property
    def has_variants(self) -> bool:
        return any(self.variants)

    def impls(self, node: int) -> tuple[str, ...]:
        """Implementation names of `node`, the default first."""
        return (DEFAULT, *(v.name for v in (self.variants[node] if self.variants else ())))

    def variant(self, node: int, impl: str | None = None) -> Variant:
        """Node `node` run as `impl` (None or "default": the node as listed). KeyError names the choices."""
        if impl is None or impl == DEFAULT:
            return Variant(DEFAULT, float(self.cost[node]), int(self.workspace[node]),
                           self.node_inputs[node], self.node_outputs[node])
        for v in self.variants[node] if self.variants else ():
            if v.name == impl:
                return v
        raise KeyError(f"{self.node_label(node)} has no implementation variant {impl!r}; it offers "
                       f"{', '.join(self.impls(node))}.")

    def without_variants(self) -> "Problem":
        """The same problem with default implementations only (what recompute-only solvers see); value
        ids are unchanged, since variant-only values come last."""
        if not self.variants and not self.num_variant_values:
            return self
        keep = self.num_values - self.num_variant_values
        return replace(self, value_bytes=self.value_bytes[:keep], value_producer=self.value_producer[:keep],
                       variants=(), num_variant_values=0)

    # -- sizes and derived tables ----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.cost)

    @property
    def num_values(self) -> int:
        return len(self.value_bytes)

    @cached_property
    def constant_bytes(self) -> int:
        """Bytes of the graph inputs, always resident, reported apart from a schedule's peak."""
        return int(self.value_bytes[self.value_producer < 0].sum())

    @cached_property
    def position(self) -> np.ndarray:
        """`position[node]` = index of the node in `order`."""
        pos = np.empty(self.num_nodes, dtype=np.int64)
        pos[self.order] = np.arange(self.num_nodes)
        return pos

    @cached_property
    def value_users(self) -> tuple[tuple[int, ...], ...]:
        """Nodes reading each value, in default-order position."""
        users: list[set[int]] = [set() for _ in range(self.num_values)]
        for node, inputs in enumerate(self.node_inputs):
            for v in inputs:
                users[v].add(node)
        pos = self.position
        return tuple(tuple(sorted(u, key=lambda n: pos[n])) for u in users)

    @cached_property
    def is_output(self) -> np.ndarray:
        mask = np.zeros(self.num_values, dtype=bool)
        mask[list(self.outputs)] = True
        return mask

    @cached_property
    def node_bytes(self) -> np.ndarray:
        """Bytes allocated by each node (sum of its output values)."""
        return np.array([int(self.value_bytes[list(out)].sum()) for out in self.node_outputs], dtype=np.int64)

    @cached_property
    def is_recomputable(self) -> np.ndarray:
        """Forward and loss nodes; backward nodes (gradients) are never rematerialized by the classic
        checkpointing baselines (Checkmate sec. 1)."""
        return np.array([p != "backward" for p in self.phase], dtype=bool)

    def node_label(self, node: int) -> str:
        return f"node {node} ({self.node_names[node]})" if self.node_names else f"node {node}"

    # -- loaders ---------------------------------------------------------------------------------

    @classmethod
    def from_graph(cls, graph: Any, costs: Mapping[int, Sequence[float]] | None = None,
                   variants: Any = None, random_nodes: Iterable[int] | None = None) -> "Problem":
        """Problem of a `runtime.format.graph.OpGraph`; `costs[node_id] = (time, workspace_bytes)` from the
        profile store (a `tasks.store.query.CostTable`, whose `.variants[node][impl]` prices the variants).
        Without `costs`, every node costs 1 and each workspace is the variant's analytic one (0 for the
        default). `variants` is a `runtime.variants.offered.GraphVariants` of the graph (None: no variants);
        `random_nodes` (None: those the graph recorded at capture, `OpGraph.recorded_random_nodes`). With
        costs, a variant the profile did not measure is left out (it has no price)."""
        n = len(graph.nodes)
        if costs is None:
            cost, workspace = np.ones(n), np.zeros(n, dtype=np.int64)
        else:
            missing = [node.id for node in graph.nodes if node.id not in costs]
            if missing:
                raise ProblemError(
                    f"the cost table has no entry for nodes {missing[:10]} of graph {graph.fingerprint[:12]} "
                    f"({len(missing)} of {n} missing); profile this graph (memplan profile) so every node "
                    f"has a time and a workspace.")
            pairs = [tuple(costs[node.id]) for node in graph.nodes]
            if any(len(p) != 2 for p in pairs):
                raise ProblemError("each cost entry must be a pair (time, workspace_bytes).")
            cost = np.array([float(p[0]) for p in pairs])
            workspace = np.array([int(p[1]) for p in pairs], dtype=np.int64)
        extra = [] if variants is None else list(variants.values)
        offered: list[tuple[Variant, ...]] = []
        for node in graph.nodes:
            specs = [] if variants is None else variants.specs.get(node.id, {}).values()
            measured = getattr(costs, "variants", {}).get(node.id, {}) if costs is not None else {}
            offered.append(tuple(
                Variant(s.name,
                        cost=1.0 if costs is None else float(measured[s.name].time_ms),
                        workspace=s.workspace if costs is None else int(measured[s.name].workspace_bytes),
                        inputs=s.inputs, outputs=s.outputs, overwrites=s.overwrites)
                for s in specs if costs is None or s.name in measured))
        if random_nodes is None:
            random_nodes = graph.recorded_random_nodes()
        return cls(
            name=str(graph.meta.get("model", "graph")),
            cost=cost,
            workspace=workspace,
            phase=tuple(node.phase for node in graph.nodes),
            node_inputs=tuple(held_reads([node.phase for node in graph.nodes], [node.inputs for node in graph.nodes],
                                         [node.outputs for node in graph.nodes],
                                         graph.meta.get("autograd_nodes") or [None] * n)),
            node_outputs=tuple(tuple(node.outputs) for node in graph.nodes),
            value_bytes=np.array([v.bytes for v in [*graph.values, *extra]], dtype=np.int64),
            value_producer=np.array([-1 if v.producer is None else v.producer for v in [*graph.values, *extra]],
                                    dtype=np.int64),
            outputs=tuple(graph.outputs),
            order=np.arange(n, dtype=np.int64),
            fingerprint=graph.fingerprint,
            node_names=tuple(node.name for node in graph.nodes),
            variants=tuple(offered) if any(offered) else (),
            num_variant_values=len(extra),
            cost_unit=None if costs is None else "ms",
            random_nodes=tuple(sorted(int(v) for v in random_nodes)),
            node_modules=tuple(graph.meta.get("node_modules") or ()),
            node_parts=tuple(graph.meta.get("node_parts") or ()),
            autograd_nodes=tuple(graph.meta.get("autograd_nodes") or ()),
            policy_dispatch=tuple(getattr(costs, "policy_ms", None) or (0.0, 0.0)),
        )

    @classmethod
    def from_node_link(cls, path: str | os.PathLike) -> "Problem":
        """Problem of a benchmark graph (networkx node-link JSON, both layouts of
        shared/benchmarks/README.md). One value per node, holding that node's output; no graph
        inputs, no workspace; the only graph output is the terminal node (Checkmate eq. 1e), so peaks
        equal Checkmate's U recurrence (eq. 2-3) with no constant overhead."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProblemError(f"cannot read node-link graph {path}: {exc}. Pass a benchmark graph JSON file.") from None
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("links"), list):
            raise ProblemError(f"{path}: not a node-link graph (expected an object with 'nodes' and 'links' lists).")
        if not data["nodes"]:
            raise ProblemError(f"{path}: the graph has no nodes; a benchmark graph needs at least one node.")
        if data["nodes"] and "cost_ram" in data["nodes"][0]:
            ids, cost, nbytes, backward, names = _columns(
                data["nodes"], ("id", "cost_cpu", "cost_ram", "backward", "name"), path)
            edges = _edges(data["links"], "source", "target", path)
            order, terminal = None, None
        else:
            ids, cost, nbytes = _columns(data["nodes"], ("name", "duration", "out_cost"), path)
            names = ids
            backward = [False] * len(ids)
            edges = _edges(data["links"], "0", "1", path)
            graph = data.get("graph", {})
            order, terminal = graph.get("order"), graph.get("target_node")
            if not isinstance(order, list) or terminal is None:
                raise ProblemError(f"{path}: the random-layered layout needs graph.order (a list) and graph.target_node.")
        n = len(ids)
        if sorted(ids) != list(range(n)):
            raise ProblemError(f"{path}: node ids must be 0..{n - 1}, got {sorted(ids)[:5]}...")
        by_id = np.argsort(ids)
        cost_array, nbytes_array = _numbers(cost, float, "cost", path), _numbers(nbytes, np.int64, "byte size", path)
        try:
            return cls.from_edges(
                cost_array[by_id], nbytes_array[by_id], edges,
                order=order, backward=np.asarray(backward, dtype=bool)[by_id], terminal=terminal, name=path.stem,
                names=[names[i] for i in by_id])
        except ProblemError as exc:
            raise ProblemError(f"{path}: {exc}") from None

    @classmethod
    def from_edges(cls, cost: Sequence[float] | np.ndarray, nbytes: Sequence[int] | np.ndarray,
                   edges: Iterable[tuple[int, int]], *,
                   order: Sequence[int] | None = None, backward: Sequence[bool] | np.ndarray | None = None,
                   terminal: int | None = None, name: str = "graph",
                   names: Sequence[str] | None = None) -> "Problem":
        """Checkmate's data-flow graph (sec. 4.1): node i outputs one value (id i) of `nbytes[i]` bytes and
        costs `cost[i]`; edge (i, j) means j reads i's output. `order` defaults to the node ids (which
        must then be topological), `terminal` (the only graph output) to the last node of the order."""
        n = len(cost)
        order = list(range(n)) if order is None else list(order)
        inputs: list[list[int]] = [[] for _ in range(n)]
        for s, t in edges:
            if not (0 <= s < n and 0 <= t < n):
                raise ProblemError(f"edge {s}->{t} names a node that does not exist (0..{n - 1}).")
            if s not in inputs[t]:
                inputs[t].append(s)
        is_backward = np.zeros(n, dtype=bool) if backward is None else np.asarray(backward, dtype=bool)
        terminal = (order[-1] if order else None) if terminal is None else terminal
        return cls(
            name=name,
            cost=np.asarray(cost, dtype=float),
            workspace=np.zeros(n, dtype=np.int64),
            phase=tuple("backward" if b else "forward" for b in is_backward),
            node_inputs=tuple(tuple(sorted(x)) for x in inputs),
            node_outputs=tuple((i,) for i in range(n)),
            value_bytes=np.asarray(nbytes, dtype=np.int64),
            value_producer=np.arange(n, dtype=np.int64),
            outputs=() if terminal is None else (int(terminal),),
            order=np.asarray(order, dtype=np.int64),
            node_names=tuple(str(x) for x in (range(n) if names is None else names)),
        )


def _columns(nodes: list, keys: tuple[str, ...], path: Path) -> tuple[list, ...]:
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or any(k not in node for k in keys):
            raise ProblemError(f"{path}: nodes[{i}] lacks one of the keys {keys} of its layout "
                               f"(see shared/benchmarks/README.md).")
    return tuple([node[k] for node in nodes] for k in keys)


def _numbers(values: list, dtype, what: str, path: Path) -> np.ndarray:
    """`values` as a finite, non-negative array of `dtype`, or a `ProblemError` naming the first bad one."""
    try:
        array = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.ndim != 1 or not np.all(np.isfinite(array)) or np.any(array < 0):
        bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 2**63),
                   values)
        raise ProblemError(f"{path}: every node's {what} must be a non-negative number below 2^63, got {bad!r}.")
    return array


def _edges(links: list, src: str, dst: str, path: Path) -> list[tuple[int, int]]:
    try:
        return [(int(link[src]), int(link[dst])) for link in links]
    except (KeyError, TypeError, ValueError):
        raise ProblemError(f"{path}: every link must hold integer {src!r} and {dst!r} keys.") from None


def _check_overwrites(p: Problem, node: int, v: Variant) -> None:
    """An in-place pair (output, input) names one of the variant's outputs and one of its inputs of the same
    size, each at most once; the input is made by a node (not a graph input) and is not a graph output."""
    outs, ins = [o for o, _ in v.overwrites], [i for _, i in v.overwrites]
    for o, i in v.overwrites:
        if o not in v.outputs or i not in v.inputs or outs.count(o) > 1 or ins.count(i) > 1 or \
                p.value_bytes[o] != p.value_bytes[i] or p.value_producer[i] < 0 or i in p.outputs or \
                any(i in u.grads for u in p.updates):
            raise ProblemError(
                f"problem {p.name!r}: variant {v.name!r} of {p.node_label(node)} overwrites input {i} with output {o}; "
                f"an in-place pair must name one of the variant's outputs and one of its inputs, each once, of equal "
                f"bytes, the input made by a node (not a graph input) and not a graph output nor a gradient the "
                f"optimizer updates in the step.")


def _check(p: Problem) -> None:
    """Consistent sizes, ids in range, costs finite and non-negative, each value allocated by the node
    that lists it, and `order` a topological order of all nodes."""
    n, nv = len(p.cost), len(p.value_bytes)
    sizes = {"workspace": len(p.workspace), "phase": len(p.phase), "node_inputs": len(p.node_inputs),
             "node_outputs": len(p.node_outputs), "order": len(p.order)}
    bad = {k: v for k, v in sizes.items() if v != n}
    if bad or len(p.value_producer) != nv or (p.node_names and len(p.node_names) != n) or \
            any(labels and len(labels) != n for labels in (p.node_modules, p.node_parts, p.autograd_nodes)):
        raise ProblemError(f"problem {p.name!r}: {n} node costs but sizes {bad}; {nv} value sizes but "
                           f"{len(p.value_producer)} producers; {len(p.node_names)} node names, "
                           f"{len(p.node_modules)} node modules, {len(p.node_parts)} node parts and "
                           f"{len(p.autograd_nodes)} autograd node labels "
                           f"(each must be 0 or {n}).")
    if not np.all(np.isfinite(p.cost)) or np.any(p.cost < 0) or np.any(p.workspace < 0) or np.any(p.value_bytes < 0):
        raise ProblemError(f"problem {p.name!r}: costs, workspaces and value bytes must be finite and non-negative.")
    if len(p.policy_dispatch) != 2 or not all(math.isfinite(c) and c >= 0 for c in p.policy_dispatch):
        raise ProblemError(f"problem {p.name!r}: policy_dispatch = {p.policy_dispatch!r} must be two finite, "
                           f"non-negative costs (forward, recomputation).")
    if any(ph not in PHASES for ph in p.phase):
        raise ProblemError(f"problem {p.name!r}: phases must be one of {PHASES}.")
    base = nv - p.num_variant_values
    if p.variants and len(p.variants) != n or not 0 <= p.num_variant_values <= nv:
        raise ProblemError(f"problem {p.name!r}: variants must list {n} nodes and num_variant_values lie in 0..{nv}.")
    for node, outs in enumerate(p.node_outputs):
        for v in outs:
            if not 0 <= v < base or p.value_producer[v] != node:
                raise ProblemError(f"problem {p.name!r}: node {node} lists output value {v}, whose producer "
                                   f"is not that node (or it is a variant-only value).")
    if np.any(p.value_producer >= n) or sum(map(len, p.node_outputs)) != int((p.value_producer[:base] >= 0).sum()):
        raise ProblemError(f"problem {p.name!r}: every produced value must be listed by its producer node.")
    for node, offered in enumerate(p.variants):
        names = [v.name for v in offered]
        if DEFAULT in names or len(set(names)) != len(names):
            raise ProblemError(f"problem {p.name!r}: {p.node_label(node)} has variant names {names}; each must be "
                               f"unique and not {DEFAULT!r}.")
        for variant in offered:
            if not (np.isfinite(variant.cost) and variant.cost >= 0 and variant.workspace >= 0) or \
                    any(not 0 <= x < nv for x in (*variant.inputs, *variant.outputs)) or \
                    any(p.value_producer[x] != node for x in variant.outputs):
                raise ProblemError(f"problem {p.name!r}: variant {variant.name!r} of {p.node_label(node)} needs a "
                                   f"finite non-negative cost and workspace, existing values, and outputs produced "
                                   f"by the node.")
            _check_overwrites(p, node, variant)
    if np.any(p.value_producer[base:] < 0):
        raise ProblemError(f"problem {p.name!r}: variant-only values must name their producer node.")
    if sorted(p.order.tolist()) != list(range(n)):
        raise ProblemError(f"problem {p.name!r}: order must be a permutation of the node ids 0..{n - 1}.")
    pos = np.empty(n, dtype=np.int64)
    pos[p.order] = np.arange(n)
    for node, inputs in enumerate(p.node_inputs):
        for v in inputs:
            if not 0 <= v < nv:
                raise ProblemError(f"problem {p.name!r}: node {node} reads value {v}, which does not exist.")
            producer = p.value_producer[v]
            if producer >= 0 and pos[producer] >= pos[node]:
                raise ProblemError(f"problem {p.name!r}: node {node} reads value {v} of node {producer}, "
                                   f"which comes later in the default order; the order must be topological.")
    if any(not 0 <= v < n for v in p.random_nodes):
        raise ProblemError(f"problem {p.name!r}: random_nodes must be node ids 0..{n - 1}.")
    if any(not 0 <= v < nv or p.value_producer[v] < 0 for v in p.outputs):
        raise ProblemError(f"problem {p.name!r}: graph outputs must be values produced by nodes.")
    grads = [g for u in p.updates for g in u.grads]
    if len(set(grads)) != len(grads) or any(not 0 <= v < nv for u in p.updates for v in (*u.grads, *u.params)) or any(
            not u.grads or p.value_producer[list(u.grads)].min() < 0 or set(u.grads) & set(p.outputs)
            or p.value_producer[list(u.params)].max(initial=-1) >= 0 or u.workspace < 0
            or not 0 <= u.carried <= u.workspace or u.sliced_workspace < 0 for u in p.updates) or \
            p.optimizer_state_bytes < 0:
        raise ProblemError(f"problem {p.name!r}: each parameter update names a distinct gradient made by a node (not "
                           f"a graph output) and a graph input parameter, with non-negative workspace and state bytes "
                           f"(carried bytes at most the workspace).")
    sync = p.gradient_sync
    if sync is not None and (sync.cap_bytes <= 0 or len(set(sync.grads)) != len(sync.grads) or p.updates
                             or not set(sync.grads) <= set(p.outputs)):
        raise ProblemError(f"problem {p.name!r}: gradient_sync needs a positive bucket cap and distinct gradients that "
                           f"are graph outputs, and does not combine with the optimizer inside the step.")
