"""Shared runtime test helpers: small models, one capture per model and session, independent schedule
builders and an independent memory simulation (exposed as fixtures: importlib mode has no conftest
imports).

Models and batches live on $MEMPLAN_TEST_DEVICE (default cpu): `MEMPLAN_TEST_DEVICE=cuda pytest
tests/runtime/test_{executor,acg_plans,hierarchical_plans,monet_plans,olla_plans,fused_loss,fused_gelu}.py
tests/runtime/test_cuda_graph.py` runs the equivalence tests, the fused ops' bit-identity tests and the
CUDA-graph replay tests on a GPU, each step with ATen's own kernels in IEEE fp32 (`runtime.measure.exact.exact_fp32`,
as tasks/validate/stage.py compares); docs/measurements/peers-gpu.md has the last such run."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.measure.exact import exact_fp32
from memplan.runtime.measure.meter import PeakMeter

DEVICE = torch.device(os.environ.get("MEMPLAN_TEST_DEVICE", "cpu"))


class ResidualMLP(nn.Module):
    """Linear -> BatchNorm -> ReLU -> residual (Linear -> Dropout) -> Linear."""

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4, p: float = 0.3):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(d_in, d), nn.BatchNorm1d(d), nn.Linear(d, d)
        self.drop, self.l3 = nn.Dropout(p), nn.Linear(d, d_out)

    def forward(self, x):
        h = F.relu(self.bn(self.l1(x)))
        h = h + self.drop(self.l2(h))
        return self.l3(h)


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def build(name: str):
    """(model, loss_fn, batch) for a model name, from a fixed seed, on DEVICE."""
    model, loss_fn, batch = _build_on_cpu(name, 2)
    return model.to(DEVICE), loss_fn, tuple(t.to(DEVICE) for t in batch)


def _build_on_cpu(name: str, n: int):
    torch.manual_seed(0)
    if name == "mlp":
        return ResidualMLP(), cross_entropy, (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config).train(), lm_loss, (torch.randint(0, 128, (n, 32)),)
    if name == "gpt2_sdpa":                    # no attention dropout: attention is one fused SDPA node
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                            eos_token_id=0, attn_pdrop=0.0, activation_function="gelu_pytorch_tanh")
        return GPT2LMHeadModel(config).train(), lm_loss, (torch.randint(0, 128, (n, 32)),)
    import torchvision
    if name == "bottleneck_resnet":            # resnet50's bottleneck residuals, one narrow block per stage
        model = torchvision.models.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10,
                                          width_per_group=16)
    elif name == "small_densenet":             # densenet121's dense concatenations, three short blocks
        model = torchvision.models.DenseNet(growth_rate=8, block_config=(3, 3, 3), num_init_features=16,
                                            bn_size=2, num_classes=10)
    elif name == "vgg11":                      # vgg11's convolutions and pools; its classifier's layers 64 wide, not
        model = torchvision.models.vgg11(num_classes=10)          # 4096 (480 MB of weights on a 7x7x512 input)
        model.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 64), nn.ReLU(True), nn.Dropout(),
                                         nn.Linear(64, 64), nn.ReLU(True), nn.Dropout(), nn.Linear(64, 10))
    else:
        model = getattr(torchvision.models, name)(num_classes=10)
    return model, cross_entropy, (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,)))


_CAPTURES: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def captured():
    """`captured(name) -> (model, loss_fn, batch, graph)`, traced once per session."""
    def get(name: str):
        if name not in _CAPTURES:
            model, loss_fn, batch = build(name)
            _CAPTURES[name] = (model, loss_fn, batch, runtime.capture(model, loss_fn, batch))
        return _CAPTURES[name]
    return get


def recompute_schedule(graph, drop, rng=None, extra=0.0):
    """A valid schedule that frees the outputs of the forward nodes in `drop` after their last forward
    read and recomputes them (recursively) right before a backward node needs them; with `rng` and
    `extra` > 0 it also recomputes random resident-input forward nodes during the backward."""
    backward = [n.id for n in graph.nodes if n.phase == "backward"]
    forward = [n.id for n in graph.nodes if n.phase != "backward"]
    read_in_backward = {v for n in backward for v in graph.nodes[n].inputs}
    last_forward_read = {}
    for n in forward:
        for v in graph.nodes[n].inputs:
            last_forward_read[v] = n
    steps, resident = [], {v.id for v in graph.values if v.producer is None}

    def compute(n):
        for v in graph.nodes[n].inputs:
            if v not in resident:
                compute(graph.values[v].producer)
        steps.append({"compute": n})
        resident.update(graph.nodes[n].outputs)

    def free(v):
        steps.append({"free": v})
        resident.discard(v)

    dropped = [v for n in drop for v in graph.nodes[n].outputs
               if v in read_in_backward and graph.values[v].kind == "activation"]
    free_after: dict[int, list[int]] = {}
    for v in dropped:
        free_after.setdefault(last_forward_read.get(v, graph.values[v].producer), []).append(v)
    for n in forward:
        compute(n)
        for v in free_after.get(n, []):
            free(v)
    for n in backward:
        if rng is not None and rng.random() < extra:
            compute(rng.choice(forward))
        compute(n)
    return steps


def chen_sqrt_n_drop(graph):
    """Forward nodes to drop for checkpointing every sqrt(n)-th forward node (Chen et al. 2016)."""
    forward = [n.id for n in graph.nodes if n.phase == "forward"]
    k = max(2, round(math.sqrt(len(forward))))
    return {n for i, n in enumerate(forward) if i % k != k - 1}


def simulated_peak(graph, schedule):
    """Peak live bytes of `schedule` under docs/plan-format.md (no workspace): a copy lives from its
    compute step through its last read before the next compute of its value; graph outputs to the end."""
    computes = [s["compute"] for s in schedule if "compute" in s]
    end = {}                              # (value, copy start) -> last step live
    newest = {}
    for i, n in enumerate(computes):
        for v in graph.nodes[n].inputs:
            if v in newest:
                end[(v, newest[v])] = i
        for v in graph.nodes[n].outputs:
            newest[v] = i
            end[(v, i)] = i
    for v in graph.outputs:
        end[(v, newest[v])] = len(computes)
    live = [0] * (len(computes) + 1)
    for (v, start), stop in end.items():
        for i in range(start, stop + 1):
            live[i] += graph.values[v].bytes
    return max(live[:len(computes)])


def train_eager(model, loss_fn, batch, seed=1):
    """Loss, gradients and buffers of one eager step on a copy of `model`, and its measured peak."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with exact_fp32(str(DEVICE)), PeakMeter(DEVICE) as meter:
        loss = loss_fn(model, *batch)
        loss.backward()
    return _result(model, loss, meter.peak_bytes)


def train_plan(model, loss_fn, batch, plan, graph=None, seed=1):
    """Same as `train_eager`, running the step under `plan`."""
    model = copy.deepcopy(model)
    step = runtime.load(plan, model, loss_fn, graph=graph)
    step.compile(*batch)
    torch.manual_seed(seed)
    with exact_fp32(str(DEVICE)), PeakMeter(DEVICE) as meter:
        loss = step(*batch)
    return _result(model, loss, meter.peak_bytes)


def train_like_eager_bitwise(model, loss_fn, batch, graph):
    """One step of `graph`'s default plan and one eager step give the same loss and gradients, bit for bit;
    returns the plan's step (for its peak)."""
    eager = train_eager(model, loss_fn, batch)
    planned = train_plan(model, loss_fn, batch, runtime.default_plan(graph), graph=graph)
    assert torch.equal(eager.loss, planned.loss)
    assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)
    return planned


def _result(model, loss, peak):
    rng = torch.cuda.get_rng_state(DEVICE) if DEVICE.type == "cuda" else torch.get_rng_state()
    return SimpleNamespace(loss=loss.detach(), peak=peak, rng=rng,
                           grads={k: p.grad for k, p in model.named_parameters()},
                           buffers={k: b.clone() for k, b in model.named_buffers()})


def assert_peak_matches(measured, predicted):
    """The meter's peak equals the predicted one on CPU (it counts exactly the tensors the memory model
    counts). On CUDA kernels also take workspace that these unprofiled test graphs do not carry (seen on
    an H100: 29 to 84 MiB above the prediction), so only the tensors' share is checked: the measured peak
    is at least the predicted one (the allocator rounds blocks up to 512 B, never down)."""
    if DEVICE.type == "cpu":
        assert measured == predicted
    else:
        assert measured >= predicted, (measured, predicted)


def assert_same_step(a, b, rtol=1e-4, atol=1e-5):
    """Equal loss, every gradient and every buffer (fp32 tolerances of the issue)."""
    torch.testing.assert_close(a.loss, b.loss, rtol=rtol, atol=atol)
    assert a.grads.keys() == b.grads.keys()
    for k in a.grads:
        assert a.grads[k] is not None and b.grads[k] is not None, k
        torch.testing.assert_close(a.grads[k], b.grads[k], rtol=rtol, atol=atol, msg=lambda m: f"grad {k}: {m}")
    assert a.buffers.keys() == b.buffers.keys()
    for k in a.buffers:
        torch.testing.assert_close(a.buffers[k], b.buffers[k], rtol=rtol, atol=atol, msg=lambda m: f"buffer {k}: {m}")


@pytest.fixture(scope="session")
def helpers():
    return SimpleNamespace(build=build, recompute_schedule=recompute_schedule, chen_sqrt_n_drop=chen_sqrt_n_drop,
                           simulated_peak=simulated_peak, train_eager=train_eager, train_plan=train_plan,
                           train_like_eager_bitwise=train_like_eager_bitwise,
                           assert_same_step=assert_same_step, assert_peak_matches=assert_peak_matches, device=DEVICE)


@pytest.fixture
def run_ranks():
    """Run a distributed worker script of this folder (`gloo_ranks.spawn`) in a process of its own, unbuffered as
    many CI runners are (each rank's line must still come out whole), and return its output."""
    def run(script: str) -> str:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        done = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return done.stdout
    return run
