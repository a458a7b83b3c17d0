"""Mutation testing of the core modules with mutmut (slow: not run in CI).

    python -m bench.mutation                       # every target, one after the other
    python -m bench.mutation simulator acg_solver  # some targets
    python -m bench.mutation --report              # rewrite docs/mutation.md from the last runs
    python -m bench.mutation acg_solver --survivors  # after adding tests: re-test only the survivors

Needs the `mutation` extra (`pip install -e '.[mutation]'`). Each target mutates one module (or the
named functions of one) in its own scratch copy of the tree, `.cache/mutation/<target>/`, and runs only
the tests that cover it; mutmut then runs, for each mutant, the tests that call the mutated function.
The score of a target is killed / tested mutants (a timeout counts as killed, a mutant no test reaches
as survived; a run stopped early leaves some mutants untested). The table between the markers of docs/mutation.md is rewritten after each target; survivors
are listed there with their diff, and each is explained by hand below the table (equivalent mutants).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / ".cache" / "mutation"
DOC = ROOT / "docs" / "mutation.md"
BEGIN, END = "<!-- mutation scores: begin (python -m bench.mutation) -->", "<!-- mutation scores: end -->"
KILLED = {1, 3, 36, -24, 24, 152, 255}          # mutmut exit codes of killed and timed-out mutants


@dataclass(frozen=True)
class Target:
    """One module under mutation: its file, the functions mutated (mutmut name globs; all when empty) and
    the tests that cover it (files or pytest node ids: slow tests of a file can be left out)."""

    path: str
    tests: tuple[str, ...]
    names: tuple[str, ...] = ()


TARGETS = {
    "simulator": Target("tasks/solve/core/simulator.py",
                        ("tests/solve/test_simulator.py", "tests/solve/test_variants_addresses.py",
                         "tests/solve/test_simulator_contract.py")),
    "plan": Target("runtime/format/plan.py",
                   ("tests/runtime/test_graph_plan.py", "tests/runtime/test_plan_v1.py",
                    "tests/runtime/test_plan_contract.py")),
    "validate": Target("tasks/validate/stage.py",
                       ("tests/pipeline/test_validate.py", "tests/pipeline/test_validate_gate.py"),
                       ("*compare_tensors*", "*peak_problem*", "*explain*", "*check_reference*", "*_verdict*")),
    "reference": Target("tasks/validate/reference.py", ("tests/pipeline/test_reference.py",),
                        ("*step_state*", "*write_state*", "*reference_state*")),
    "checkmate_model": Target("tasks/solve/core/remat_milp.py",
                              ("tests/solve/test_checkmate_model.py",
                               *(f"tests/solve/test_checkmate.py::test_ilp_finds_the_exhaustive_optimum_on_linear_graphs[{n}]"
                                 for n in range(1, 6)),
                               "tests/solve/test_checkmate.py::test_paper_formulation_agrees_with_tight",
                               "tests/solve/test_checkmate.py::test_approx_is_feasible_and_bracketed_by_the_optimum",
                               "tests/solve/test_checkmate.py::test_infeasible_budget_gets_a_lower_bound",
                               "tests/solve/test_feasible_budgets.py::test_checkmate_charges_each_nodes_workspace")),
    "acg_search": Target("tasks/solve/acg/search.py",
                         ("tests/solve/test_acg_search.py", "tests/solve/test_acg_solver.py",
                          "tests/solve/test_acg_budget.py")),
    "acg_solver": Target("tasks/solve/acg/solver.py",
                         ("tests/solve/test_acg_solver.py", "tests/solve/test_acg_budget.py")),
    "budget": Target("tasks/config/values.py",
                     ("tests/pipeline/test_config.py", "tests/pipeline/test_budget.py"),
                     ("*Budget*", "*parse_budget*", "*_budget_help*", "*_toml_value*")),
}


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def mutant_globs(target: Target) -> list[str]:
    """mutmut mutant-name globs for the target's functions (mutmut names a mutant
    `<module>.x_<function>__mutmut_<n>` or `<module>.xǁ<Class>ǁ<method>__mutmut_<n>`)."""
    return [f"{module_name(target.path)}.{pattern}" for pattern in target.names]


def prepare(name: str, target: Target) -> Path:
    """A scratch copy of the tracked tree with a [tool.mutmut] section for `target`. A copy left by an
    earlier run is updated in place, so mutmut re-tests only the mutants whose function changed."""
    work = SCRATCH / name
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for rel in files:
        source = ROOT / rel
        copy = work / rel
        if source.is_file() and (not copy.exists() or copy.stat().st_mtime_ns != source.stat().st_mtime_ns):
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
    tests = [t for t in target.tests if (work / t.partition("::")[0]).exists()]
    section = "\n".join([
        "", "[tool.mutmut]",
        'source_paths = ["runtime", "tasks", "flows"]',
        f"only_mutate = [{json.dumps(target.path)}]",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'also_copy = ["pipeline.toml", "docs"]',           # files the tests read besides the code
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0", "-x", "-q"]',
        "use_git_change_detection = false",
        'process_isolation = "forkserver"',     # torch tests: autograd refuses to run in a child forked after it ran
        "timeout_multiplier = 5.0",
        "timeout_constant = 10.0", ""])
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + section)
    return work


def retest_survivors(work: Path, target: Target) -> None:
    """Let the next `mutmut run` test the target's survivors again (and only them) with the current tests:
    mutmut copies the tree into `mutants/` once and keeps a verdict until the mutated function changes,
    so the tests are copied there and the survivors' verdicts cleared."""
    for test in target.tests:
        source = work / test.partition("::")[0]
        if source.exists():
            shutil.copy2(source, work / "mutants" / source.relative_to(work))
    meta_path = work / "mutants" / f"{target.path}.meta"
    meta = json.loads(meta_path.read_text())
    codes = meta["exit_code_by_key"]
    for key, code in codes.items():
        if code is not None and code not in KILLED:
            codes[key] = None
    meta_path.write_text(json.dumps(meta, indent=4))


def run_target(name: str, target: Target, jobs: int, survivors_only: bool = False) -> dict:
    work = prepare(name, target)
    saved = SCRATCH / f"{name}.json"
    earlier = json.loads(saved.read_text()).get("seconds", 0) if survivors_only and saved.exists() else 0
    if survivors_only:
        retest_survivors(work, target)
    env = dict(os.environ, MEMPLAN_BENCHMARKS=os.environ.get(
        "MEMPLAN_BENCHMARKS", str(ROOT.parent.parent / "shared" / "benchmarks" / "graphs")))
    env.pop("PYTHONPATH", None)
    # each mutant's tests run in a forked child: torch ops there hang when the forking process ran OpenMP
    # threads (libgomp is not fork-safe), a false "timeout" kill
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    mutmut = Path(sys.executable).with_name("mutmut")
    start = time.perf_counter()
    with open(work / "mutmut.log", "w") as log:
        subprocess.run([str(mutmut), "run", "--max-children", str(jobs), *mutant_globs(target)], cwd=work, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=False)
    result = collect(name, target)
    result["seconds"] = earlier + round(time.perf_counter() - start)
    saved.write_text(json.dumps(result, indent=1))
    return result


def collect(name: str, target: Target) -> dict:
    """Counts and survivors from mutmut's meta file of the target (`mutmut show NAME` in the scratch copy
    prints a survivor's diff)."""
    work = SCRATCH / name
    meta = json.loads((work / "mutants" / f"{target.path}.meta").read_text())
    globs = mutant_globs(target) or ["*"]
    codes = {k: v for k, v in meta["exit_code_by_key"].items() if any(fnmatch.fnmatch(k, g) for g in globs)}
    checked = {k: v for k, v in codes.items() if v is not None}
    survivors = sorted(k for k, v in checked.items() if v not in KILLED)
    killed = sum(1 for v in codes.values() if v in KILLED)
    return {"target": name, "path": target.path, "functions": list(target.names), "tests": list(target.tests),
            "mutants": len(codes), "tested": len(checked), "killed": killed, "survived": len(survivors),
            "score": round(100 * killed / max(len(checked), 1), 1), "survivors": survivors}


def report() -> None:
    """Rewrite the generated block of docs/mutation.md from the saved results."""
    rows, details = [], []
    for name in TARGETS:
        saved = SCRATCH / f"{name}.json"
        if not saved.exists():
            continue
        r = json.loads(saved.read_text())
        scope = r["path"] + (f" ({', '.join(r['functions'])})" if r["functions"] else "")
        rows.append(f"| {name} | `{scope}` | {r['mutants']} | {r['tested']} | {r['killed']} | {r['survived']} | "
                    f"**{r['score']}%** | {r.get('seconds', '')} |")
        details.append(f"- {name}: " + (", ".join(f"`{k.rpartition('.')[2]}`" for k in r["survivors"]) or "none"))
    block = "\n".join([BEGIN, "", "| target | mutated | mutants | tested | killed | survived | score | seconds |",
                       "|---|---|---|---|---|---|---|---|", *rows, "",
                       "Survivors (`mutmut show NAME` in `.cache/mutation/<target>/` prints the diff):", "",
                       *details, "", END])
    text = DOC.read_text() if DOC.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + block + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"targets to run (default: all): {', '.join(TARGETS)}")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested in parallel (default 1)")
    parser.add_argument("--report", action="store_true", help="only rewrite docs/mutation.md")
    parser.add_argument("--survivors", action="store_true",
                        help="test only the last run's survivors again, with the current tests (after adding tests); "
                             "the seconds reported add up the runs")
    args = parser.parse_args()
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    if not args.report:
        for name in args.targets or TARGETS:
            result = run_target(name, TARGETS[name], args.jobs, args.survivors)
            print(f"{name}: {result['killed']}/{result['mutants']} killed ({result['score']}%), "
                  f"{result['seconds']} s", flush=True)
            report()
    report()


if __name__ == "__main__":
    main()
