"""Profiling implementation variants: a row per (node, variant), measured like the default rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.profile.stage import ProfileSettings, profile_graph
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.store.query import connect, load_costs

FAST = ProfileSettings(warmup=0, repeats=1, rounds=2, threads=1)
SCALARS = 16
"""Bytes of the 0-dim tensors wrapping an op's scalar operands, which the profile's allocator meter sees
and a variant rule does not declare."""


@pytest.fixture(scope="module")
def graph():
    """Conv -> ReLU -> conv -> ReLU6 -> linear, cross-entropy: both rules of the `mask` variant."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU6(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    batch = (torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    return runtime.capture(net, lambda m, x, y: F.cross_entropy(m(x), y), batch)


def test_mask_variants_get_rows_that_planners_price(store, graph):
    run = profile_graph(graph, "cpu", FAST, model="tiny", progress=False)
    variants = graph_variants(graph)
    rows = connect().execute("SELECT node_id, impl, input_bytes, output_bytes, workspace_bytes FROM profiles").fetchall()
    by = {(n, impl): (i, o, w) for n, impl, i, o, w in rows}
    assert run.rows == len(rows) == len(graph.nodes) + sum(map(len, variants.specs.values()))
    assert {k for k in by if k[1] == "mask"} == {(n, "mask") for n, specs in variants.specs.items() if "mask" in specs}
    assert {k for k in by if k[1] == "bitmask"} == {(n, "bitmask") for n, specs in variants.specs.items()
                                                    if "bitmask" in specs}
    assert {n for n, specs in variants.specs.items() if "mask" in specs} == {
        n.id for n in graph.nodes if n.targets[0] in ("aten.relu.default", "aten.threshold_backward.default",
                                                      "aten.hardtanh.default", "aten.hardtanh_backward.default")}

    relu = next(n.id for n in graph.nodes if n.targets[0] == "aten.relu.default")
    mask = variants.specs[relu]["mask"].outputs[-1]
    out = graph.nodes[relu].outputs[0]
    backward = next(n for n, s in variants.specs.items() if mask in s["mask"].inputs and n != relu)
    assert graph.nodes[backward].targets[0] == "aten.threshold_backward.default"
    assert by[relu, "mask"][1] == by[relu, "default"][1] + variants.value(graph, mask).bytes
    assert by[backward, "mask"][0] < by[backward, "default"][0]          # reads a 1-byte mask, not the output
    assert by[backward, "default"][0] - by[backward, "mask"][0] == graph.values[out].bytes - variants.value(graph, mask).bytes

    hardtanh = next(n.id for n in graph.nodes if n.targets[0] == "aten.hardtanh.default")
    declared = variants.specs[hardtanh]["mask"].workspace                  # the ge temporary
    assert 0 < declared <= by[hardtanh, "mask"][2] <= declared + SCALARS

    numel = graph.values[out].bytes // 4                  # the bit mask: 1 bit per element, 8 per byte
    packed = variants.specs[relu]["bitmask"].outputs[-1]
    assert variants.value(graph, packed).bytes == (numel + 7) // 8 == variants.value(graph, mask).bytes // 8
    assert by[relu, "bitmask"][1] == by[relu, "default"][1] + (numel + 7) // 8
    assert by[backward, "bitmask"][0] == by[backward, "mask"][0] - numel + (numel + 7) // 8
    for node in (relu, backward, hardtanh):               # measured workspace == the declared one
        declared = variants.specs[node]["bitmask"].workspace
        assert 0 < declared <= by[node, "bitmask"][2] <= declared + SCALARS, node

    # the ReLU in place (its input, the convolution's output, has no other reader): the output allocates
    # nothing; the in-place mask variants allocate just the mask, with the mask rules' workspace
    assert {k for k in by if "inplace" in k[1]} == {(relu, f"{r}inplace") for r in ("", "mask-", "bitmask-")}
    assert by[relu, "inplace"][1] == 0 and by[relu, "inplace"][2] <= SCALARS
    assert by[relu, "mask-inplace"][1] == variants.value(graph, mask).bytes and by[relu, "mask-inplace"][2] <= SCALARS
    declared = variants.specs[relu]["bitmask"].workspace
    assert by[relu, "bitmask-inplace"][1] == (numel + 7) // 8
    assert declared <= by[relu, "bitmask-inplace"][2] <= declared + SCALARS

    costs = load_costs(graph.fingerprint, "cpu")
    problem = Problem.from_graph(graph, costs, variants)
    assert problem.variant(backward, "mask").cost == costs.variants[backward]["mask"].time_ms > 0
    assert problem.variant(relu, "inplace").overwrites == ((out, graph.nodes[relu].inputs[0]),)


class TinyAttention(nn.Module):
    """LayerNorm -> q, k, v -> causal SDPA (the CPU flash kernel: no dropout) -> linear."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.norm, self.qkv, self.out, self.heads = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, 4), heads

    def forward(self, x):
        b, length, d = x.shape
        q, k, v = (t.view(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, d)
        return self.out(h).mean(1)


def test_every_rule_gets_rows_and_the_compact_backward_reads_less(store):
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                        nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    graphs = [runtime.capture(cnn, loss_fn, (torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))),
              runtime.capture(TinyAttention(), loss_fn, (torch.randn(2, 8, 16), torch.zeros(2, dtype=torch.long)))]
    for graph, rules in zip(graphs, [{"mask", "bitmask", "output", "compact", "inplace", "native"}, {"output", "math"}]):
        profile_graph(graph, "cpu", FAST, model="tiny", progress=False)
        variants = graph_variants(graph)
        assert {s.rule for specs in variants.specs.values() for s in specs.values()} == rules
        costs = load_costs(graph.fingerprint, "cpu")
        problem = Problem.from_graph(graph, costs, variants)
        for node, specs in variants.specs.items():
            for name in specs:
                row = costs.variants[node][name]
                assert problem.variant(node, name).workspace == row.workspace_bytes
                assert problem.variant(node, name).cost == row.time_ms > 0
    rows = connect().execute("SELECT fingerprint, node_id, impl, input_bytes FROM profiles").fetchall()
    by = {(f, n, impl): i for f, n, impl, i in rows}
    cnn_graph = graphs[0]
    pool_backward = next(n.id for n in cnn_graph.nodes if n.targets[0] == "aten.max_pool2d_with_indices_backward.default")
    fp = cnn_graph.fingerprint
    # reads the output gradient and 1-byte windows, not the forward input and 8-byte indices
    assert by[fp, pool_backward, "compact"] < by[fp, pool_backward, "default"] / 4
