"""pipeline.toml's stages as plain functions, in this process, without Prefect: for a GPU host that has
torch but not Prefect (a lent device machine), to validate plans on its device.

    python bench/stages_on_device.py [pipeline.toml] [--extra more.toml] [--json out.json]

Per model and batch size: trace, profile (into a temporary store), eager PyTorch's reference step
(`tasks.validate.reference.measure_reference`); per matrix cell: solve (`tasks.solve_stage.solve_case`), validate
against the reference and eager PyTorch's step time (`tasks.validate.stage.validate_plan`) and
publish into a temporary `plans/` when validation passes. `--extra` appends a TOML file's text to the
config (more models and plans). Prints one line per cell: budget, predicted and measured peak, eager's
peak, step times, the largest gradient error, and why a plan was rejected.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from memplan.runtime.format.plan import Plan
from memplan.tasks.config import expand_matrix, parse_config
from memplan.tasks.models import resolve_device
from memplan.tasks.profile.stage import ProfileSettings, profile_graph
from memplan.tasks.publish import publish
from memplan.tasks.validate.reference import measure_reference
from memplan.tasks.solve_stage import solve_case
from memplan.tasks.trace import trace
from memplan.tasks.validate.stage import validate_plan

MIB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="pipeline.toml")
    ap.add_argument("--extra", help="a TOML file appended to the config (more [[models]] and [[plans]])")
    ap.add_argument("--json", help="write every cell's record here")
    args = ap.parse_args()
    text = Path(args.config).read_text() + (Path(args.extra).read_text() if args.extra else "")
    config = parse_config(tomllib.loads(text), args.config)
    device = resolve_device(config.device)
    work = Path(tempfile.mkdtemp(prefix="memplan-stages-"))
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, work files in {work}", flush=True)

    traced, graphs, runs, references = {}, {}, {}, {}
    for m in config.models:
        for b in m.batch_sizes:
            start = time.perf_counter()
            record, graph = trace(m, b, device, config.seed, work / "cache")
            traced_s = time.perf_counter() - start
            run = profile_graph(graph, device, ProfileSettings(config.profile.warmup, config.profile.repeats, config.seed),
                                model=m.name, root=work / "store", progress=False)
            print(f"{m.name} b{b}: {record.nodes} nodes, trace {traced_s:.1f} s, profile "
                  f"{time.perf_counter() - start - traced_s:.1f} s", flush=True)
            traced[m.name, b], graphs[record.fingerprint], runs[m.name, b] = record, graph, run
            references[m.name, b] = measure_reference(m, b, device, config.seed,
                                                      work / "references" / f"{m.name}-b{b}.safetensors")

    cells = []
    for case in expand_matrix(config):
        record, run = traced[case.model.name, case.batch_size], runs[case.model.name, case.batch_size]
        start = time.perf_counter()
        reference = references[case.model.name, case.batch_size]
        solved = solve_case(record.path, case.plan.solver, case.budget.of_eager(reference.peak_bytes),
                            case.plan.solve_settings(), run.device,
                            work / "store", work / "solutions" / f"{case.alias}.json")
        cell = {"alias": case.alias, "solve_s": time.perf_counter() - start}
        if not solved.feasible:
            cells.append(cell | {"status": "infeasible", "message": solved.message})
            print(f"{case.alias}: infeasible ({solved.message})", flush=True)
            continue
        plan = Plan.load(solved.plan_path)
        v = validate_plan(plan, case.model, case.batch_size, device, config.seed, config.validation, reference,
                          graph=graphs.get(plan.fingerprint))
        if v.passed:
            publish(plan, v, work / "plans", alias=case.alias, model=case.model.name, batch_size=case.batch_size,
                    budget=case.budget.label)
        predicted_time = solved.objective / solved.checkpoint_all_cost
        cells.append(cell | {"status": "published" if v.passed else "rejected", "predicted_time": predicted_time}
                     | v.to_json())
        print(f"{case.alias}: {'published' if v.passed else 'rejected'}; budget {v.budget_bytes / MIB:.2f} MiB, "
              f"predicted {v.predicted_peak_bytes / MIB:.2f}, measured {v.measured_peak_bytes / MIB:.2f} "
              f"(eager {v.eager_peak_bytes / MIB:.2f}: {v.measured_peak_bytes / v.eager_peak_bytes:.3f}x); step "
              f"{v.measured_step_ms:.2f} ms against eager's {v.eager_step_ms:.2f} ({1 + v.overhead:.3f}x, predicted "
              f"{predicted_time:.3f}x); max |grad error| {v.max_abs_error:.2g}"
              + ("" if v.passed else f"; {' '.join(v.reasons)}"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))
    print(f"{sum(c['status'] == 'published' for c in cells)} of {len(cells)} published")


if __name__ == "__main__":
    main()
