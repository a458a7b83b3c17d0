"""Implementation variants checked where they run: the `math` attention variant with grouped-query and
multi-query heads (Llama 3, Mistral, Qwen), a variant that fails to profile dropped on its node (not the run),
and `variants = "bit-identical"` offering only the variants the profile found bit-identical on its device."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
import memplan.runtime.variants.kernels as variant_kernels
from memplan.runtime.measure.exact import exact_fp32
from memplan.runtime.format.plan import Plan
from memplan.runtime.variants.kernels import attention_math_backward, attention_math_forward
from memplan.tasks.problems import load_problem
from memplan.tasks.profile.stage import ProfileSettings, VariantUnavailableWarning, profile_graph
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import checked_solution
from memplan.tasks.solve_stage import plan_of
from memplan.tasks.store.query import connect, load_costs

aten = torch.ops.aten
FAST = ProfileSettings(warmup=0, repeats=1, rounds=2, threads=1)
ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("kv_heads", [8, 2, 1])          # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("causal", [True, False])
def test_math_attention_matches_the_flash_kernel_with_shared_key_value_heads(kv_heads, causal):
    """Output and q, k, v gradients of the math variant equal ATen's CPU flash attention (the default op,
    which shares each key/value head among heads // kv_heads query heads) to float64 rounding."""
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 8, 16, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, kv_heads, 12, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)

    ours, probs = attention_math_forward(q, k, v, causal, None, None, list(out.stride()), [2, 8, 16, 12])
    grads = attention_math_backward(grad, q, k, v, probs, None, [list(t.stride()) for t in expected])
    torch.testing.assert_close(ours, out, rtol=1e-12, atol=1e-12)
    for name, got, want in zip("qkv", grads, expected):
        assert got.shape == want.shape and got.stride() == want.stride(), name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad {name}: {m}")


def llama_gqa():
    """A 2-layer Llama-style decoder with 8 query heads sharing 2 key/value heads, its loss and a batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).train()
    return model, (lambda m, ids: m(input_ids=ids, labels=ids).loss), (torch.randint(0, 256, (2, 32)),)


@pytest.fixture(scope="module")
def llama():
    model, loss_fn, batch = llama_gqa()
    return model, loss_fn, batch, runtime.capture(model, loss_fn, batch)


def run_step(model, loss_fn, batch, plan=None, graph=None):
    """Loss and parameter gradients of one step on a copy of `model`: eager, or under `plan`."""
    model = copy.deepcopy(model)
    step = None
    if plan is not None:
        step = runtime.load(plan, model, loss_fn, graph=graph)
        step.compile(*batch)
    with exact_fp32("cpu"):
        if step is None:
            loss = loss_fn(model, *batch)
            loss.backward()
        else:
            loss = step(*batch)
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def attention_nodes(graph):
    return [n.id for n in graph.nodes if n.targets[0].startswith(ATTENTION)]


def test_a_grouped_query_decoder_profiles_and_trains_like_eager_with_math_attention(store, llama, tmp_path):
    model, loss_fn, batch, graph = llama
    nodes = attention_nodes(graph)
    assert len(nodes) == 4                                   # two layers, forward and backward
    assert {graph.values[graph.nodes[n].inputs[1]].shape[1] for n in nodes if graph.nodes[n].phase == "forward"} == {2}
    profile_graph(graph, "cpu", FAST, model="llama-gqa", progress=False)
    costs = load_costs(graph.fingerprint, "cpu")
    assert all(costs.variants[n]["math"].time_ms > 0 for n in nodes)
    graph.save(tmp_path / "g.json")
    problem = load_problem(tmp_path / "g.json", variants="all").problem
    assert all("math" in problem.impls(n) for n in nodes)

    schedule = [{"compute": n.id, "impl": "math"} if n.id in nodes else {"compute": n.id} for n in graph.nodes]
    simulate(problem, schedule)                              # a valid schedule of the problem
    eager_loss, eager_grads = run_step(model, loss_fn, batch)
    loss, grads = run_step(model, loss_fn, batch, Plan(graph.fingerprint, schedule), graph)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], eager_grads[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {k}: {m}")


def test_a_variant_that_fails_is_dropped_on_its_node_and_the_run_goes_on(store, llama, tmp_path, monkeypatch):
    _, _, _, graph = llama
    nodes = attention_nodes(graph)
    forward = [n for n in nodes if graph.nodes[n].phase == "forward"]

    def broken(*args):
        raise RuntimeError("forced failure of the math attention")
    monkeypatch.setattr(variant_kernels, "attention_math_forward", broken)
    with pytest.warns(VariantUnavailableWarning) as caught:
        profile_graph(graph, "cpu", FAST, model="llama-gqa", progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, VariantUnavailableWarning)]
    for n in forward:
        assert any(f"node {n} ({graph.nodes[n].name}" in m and "variant 'math'" in m and "forced failure" in m
                   for m in messages), n

    rows = connect().execute("SELECT node_id, unavailable, exact FROM profiles WHERE impl = 'math'").fetchall()
    by = {n: (why, exact) for n, why, exact in rows}
    assert set(by) == set(nodes)
    for n in forward:
        assert "forced failure of the math attention" in by[n][0] and by[n][1] is None
    for n in set(nodes) - set(forward):                      # the backward reads the probabilities no one made
        assert "reads variant value" in by[n][0]
    costs = load_costs(graph.fingerprint, "cpu")             # the run is complete; the variant has no costs
    assert all("math" not in costs.variants[n] and "default" in costs.variants[n] for n in nodes)
    graph.save(tmp_path / "g.json")
    problem = load_problem(tmp_path / "g.json", variants="all").problem
    assert all(problem.impls(n) == ("default",) for n in nodes)


def test_the_default_implementation_failing_still_stops_the_profile(store, llama):
    _, _, _, graph = llama
    fail_on = attention_nodes(graph)[0]

    def node_function(g, node):
        fn = runtime.node_function(g, node)
        if node != fail_on:
            return fn

        def broken(*args):
            raise RuntimeError("forced failure of the default")
        return broken
    with pytest.raises(RuntimeError, match=rf"Profiling node {fail_on} .*forced failure of the default"):
        profile_graph(graph, "cpu", FAST, model="llama-gqa", node_function=node_function,
                      variant_function=runtime.variant_function, progress=False)


class PoolNet(nn.Module):
    """Conv -> ReLU -> max-pool -> conv -> linear: ReLU masks and the compact max-pool, all bit-identical rules."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.c2(F.max_pool2d(torch.relu(self.c1(x)), 3, 2, 1)).flatten(1))


def test_a_bit_identical_plan_skips_a_variant_not_exact_on_this_device(store, tmp_path, monkeypatch):
    """The compact max-pool backward perturbed by one ulp: the profile finds it not exact, so a bit-identical
    problem does not offer it (the other exact variants stay), and a plan running the ReLU mask variants
    trains bit for bit like eager, its provenance saying each variant it runs was verified exact on cpu."""
    torch.manual_seed(0)
    model, batch = PoolNet(), (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    graph = runtime.capture(model, loss_fn, batch)
    exact_backward = variant_kernels.max_pool_backward_from_windows

    def one_ulp_off(*args):
        grad = exact_backward(*args)
        return torch.nextafter(grad, torch.full_like(grad, float("inf")))
    monkeypatch.setattr(variant_kernels, "max_pool_backward_from_windows", one_ulp_off)

    profile_graph(graph, "cpu", FAST, model="poolnet", progress=False)
    pool_backward = next(n.id for n in graph.nodes if n.targets[0] == "aten.max_pool2d_with_indices_backward.default")
    costs = load_costs(graph.fingerprint, "cpu")
    assert costs.variants[pool_backward]["compact"].exact is False
    graph.save(tmp_path / "g.json")
    loaded = load_problem(tmp_path / "g.json", variants="bit-identical")
    problem = loaded.problem
    assert "compact" in load_problem(tmp_path / "g.json", variants="all").problem.impls(pool_backward)
    assert problem.impls(pool_backward) == ("default",)
    offered = {(n, impl) for n in range(problem.num_nodes) for impl in problem.impls(n) if impl != "default"}
    assert {impl for _, impl in offered} >= {"mask", "bitmask", "compact"}    # the ReLU's, the forward pool's
    assert all(costs.variants[n][impl].exact is True for n, impl in offered)

    # the ReLU in place with its mask and its backward from the mask (the compact forward pool alone would leave
    # the default backward without the int64 indices it reads)
    schedule = [("compute", n, next((i for i in ("mask-inplace", "mask") if i in problem.impls(n)), "default"))
                for n in range(problem.num_nodes)]
    solution = checked_solution(problem, "mask-variants", simulate(problem, schedule).peak_bytes, schedule)
    plan = plan_of(loaded, solution, loaded.device)
    uses = plan.provenance["variants"]
    assert {u["impl"] for u in uses} == {"mask-inplace", "mask"}
    assert all(u["exact"] is True and u["verified_on"] == "cpu" for u in uses)
    assert pool_backward not in {n for u in uses for n in u["nodes"]}

    eager_loss, eager_grads = run_step(model, loss_fn, batch)
    loss, grads = run_step(model, loss_fn, batch, Plan.load(plan.to_json()), graph)
    assert torch.equal(loss, eager_loss)
    assert all(torch.equal(grads[k], eager_grads[k]) for k in eager_grads)
