"""memplan: a memory planner for PyTorch training.

The checkout's folders are this package's rooms (setup.py maps them): `memplan.runtime` is `runtime/`
(capture, plan format, execution; torch only), `memplan.tasks` is `tasks/` (the stages and the solvers),
`memplan.flows` is `flows/` (Prefect flows and the `memplan` command).

The training entry points are exported lazily (`import memplan` imports neither torch nor Prefect): the runtime's
`load`, `apply`, `capture`, and `compile_step`, a step compiled by inductor in the compiled form; and the chunked
language-model loss (`chunked_linear_cross_entropy`, `chunked_causal_lm_loss`, `ChunkedCausalLMLoss`:
runtime/chunked_loss.py).

`plan(model, loss_fn, batch, max_overhead=... | budget=...)` makes one validated plan in this process by the stages
`memplan run` runs (flows/python_api.py); `plan.save(path)`, then `load(path, model, loss_fn)`.

`fit("pipeline.toml", model=..., max_overhead=0.10, device_memory="16 GiB")` is `memplan fit`: the largest batch
(or sequence) that eager, per-block checkpointing and memplan fit, as a `FitAnswer` record (flows/fit.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChunkedCausalLMLoss", "OpGraph", "Plan", "apply", "capture", "chunked_causal_lm_loss",
           "chunked_linear_cross_entropy", "compile_step", "default_plan", "fit", "load", "plan"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    if name == "compile_step":
        from memplan.tasks.compiled.form import compile_step

        return compile_step
    if name == "fit":                           # memplan.fit: `memplan fit` as a call returning its FitAnswer
        from memplan.flows.fit import run_fit

        return run_fit
    if name == "plan":                          # memplan.plan: trace, profile, solve, validate (flows/python_api.py)
        from memplan.flows.python_api import plan

        return plan
    from memplan import runtime

    return getattr(runtime, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
