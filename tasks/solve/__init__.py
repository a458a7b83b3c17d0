"""Solvers for memory-constrained schedules (torch-free), chosen by name from one registry.

`SOLVERS[name]` is a `SolverSpec`: the solver function `(problem, budget_bytes, SolveOptions) ->
Solution`, a one-line summary, the dataclass of its typed options (one `help` per field) and whether
it chooses implementation variants. Recompute-only solvers see the problem without variants. Every
returned schedule has been checked by the simulator (tasks/solve/core/simulator.py), the single definition
of memory.

Adding a solver: write `my_solver(problem, budget, options) -> Solution` in its own module (returning
`checked_solution(...)`), and add one `SolverSpec` line below; tests/pipeline/example_solver.py is the
checked example (tests/pipeline/test_example_solver.py runs it through `memplan solve`, `memplan run` and
`runtime.load`).
"""

from __future__ import annotations

from memplan.tasks.solve import baselines, checkmate, greedy
from memplan.tasks.solve.dtr import DtrOptions, dtr
from memplan.tasks.solve.moccasin import MoccasinOptions, moccasin
from memplan.tasks.solve.acg.solver import AcgOptions, acg
from memplan.tasks.solve.hierarchical import HierarchicalOptions, hierarchical
from memplan.tasks.solve.monet import MonetOptions, block_rung, monet, monet_noop
from memplan.tasks.solve.olla import OllaOptions, olla
from memplan.tasks.solve.policy_solver import PolicyOptions, selective_policy
from memplan.tasks.solve.core.options import OptionError, SolverSpec, describe_options, parse_options
from memplan.tasks.solve.core.portfolio import CHEAP, best_known
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.solution import Solution, SolveOptions

SOLVERS: dict[str, SolverSpec] = {}
"""Every solver by name. A solver calling others (warm starts, blocks) gets them as `peers` here."""
SOLVERS.update({spec.name: spec for spec in (
    SolverSpec("checkpoint-all", baselines.checkpoint_all, "every node once in the default order, no recomputation."),
    SolverSpec("chen-sqrt-n", baselines.chen_sqrt_n, "Chen et al.'s sqrt(n) segments (linear graphs only)."),
    SolverSpec("chen-greedy", baselines.chen_greedy, "Chen et al.'s greedy segments for the budget (linear graphs only)."),
    SolverSpec("griewank-log-n", baselines.griewank_log_n, "Griewank's revolve, log(n) memory (linear graphs only)."),
    SolverSpec("ap-sqrt-n", baselines.ap_sqrt_n, "sqrt(n) checkpoints among the forward graph's articulation points."),
    SolverSpec("ap-greedy", baselines.ap_greedy, "greedy checkpoints among the articulation points for the budget."),
    SolverSpec("linearized-sqrt-n", baselines.linearized_sqrt_n, "sqrt(n) checkpoints on the topological order."),
    SolverSpec("linearized-greedy", baselines.linearized_greedy, "greedy checkpoints on the topological order."),
    SolverSpec("module-checkpoint", baselines.module_checkpoint,
               "torch.utils.checkpoint around every n-th module recorded at capture, as users write it.",
               baselines.ModuleCheckpointOptions),
    SolverSpec("selective-policy", selective_policy,
               "per-op keep/recompute per recorded module, as selective checkpointing runs it (runtime.apply).",
               PolicyOptions, policy_form=True),
    SolverSpec("remat-greedy", greedy.remat_greedy, "greedy: keep the values whose recomputation is dearest per byte."),
    SolverSpec("dtr", dtr, "Dynamic Tensor Rematerialization run offline: evict by h = cost / (bytes * staleness).",
               DtrOptions, variants=True),
    SolverSpec("checkmate-approx", checkmate.checkmate_approx, "Checkmate's LP relaxation + two-phase rounding.",
               checkmate.CheckmateApproxOptions, portfolio=True),
    SolverSpec("checkmate", checkmate.checkmate, "Checkmate's optimal rematerialization MILP (eq. 9).",
               checkmate.CheckmateOptions, portfolio=True, peers=SOLVERS),
    SolverSpec("moccasin", moccasin, "MOCCASIN: retention intervals on OR-tools CP-SAT, at most C computations per node.",
               MoccasinOptions, portfolio=True),
    SolverSpec("acg", acg, "optimal gradient checkpoints on the division tree of the graph (Feng & Huang).",
               AcgOptions),
    SolverSpec("hierarchical", hierarchical, "chain of blocks, exact per-block ladders, chain dynamic program (Rockmate).",
               HierarchicalOptions, variants=True, portfolio=True, peers={"monet-block": block_rung}),
    SolverSpec("monet", monet, "MONeT's 0-1 program: checkpoints and implementation variants jointly (eq. 9).",
               MonetOptions, variants=True, portfolio=True, peers=SOLVERS),
    SolverSpec("monet-noop", monet_noop, "MONeT's 0-1 program, checkpoints only (MONeT-NoOp).",
               MonetOptions, portfolio=True, peers=SOLVERS),
    SolverSpec("olla", olla, "OLLA's lifetime ILP: the order minimizing the peak, no recomputation (eq. 14).",
               OllaOptions),
)})


def solve(problem: Problem, solver: str, budget_bytes: int, options: SolveOptions | None = None) -> Solution:
    """Run the solver named `solver`; a portfolio solver's answer is never worse than the cheap solvers', their
    implementation variants counted (tasks.solve.core.portfolio), unless `options.portfolio` is False. Raises
    KeyError listing the known names for an unknown solver and OptionError for options it does not take."""
    if solver not in SOLVERS:
        raise KeyError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    spec, options = SOLVERS[solver], options or SolveOptions()
    solution = spec(problem, budget_bytes, options)
    if spec.portfolio and options.portfolio:
        solution = best_known(problem, int(budget_bytes), solution, options, {name: SOLVERS[name] for name in CHEAP},
                              same_space=spec.problem_for(problem) is problem)
    return solution


__all__ = ["SOLVERS", "OptionError", "SolverSpec", "describe_options", "parse_options", "solve"]
