"""`python -m memplan.tasks.solve > docs/solvers.md`: the solver catalogue, generated from the registry."""

from memplan.tasks.solve import CHEAP, SOLVERS, describe_options

PAPERS = (
    ('`checkmate`',
     'Jain et al., *Checkmate* (MLSys 2020), sec. 4',
     'Optimal rematerialization: the MILP of eq. (9) (frontier-advancing stages, FREE linearization, '
     'the eliminations of 4.8), solved by HiGHS or Gurobi with a warm start; reports bound and gap.'),
    ('`checkmate-approx`',
     'Checkmate sec. 5',
     'LP relaxation with two-phase rounding (Algorithm 2), swept over rounding thresholds and budget '
     "allowances (each LP re-solved from the previous basis); about 40 s on the default pipeline's "
     '160-node graphs, about 6 minutes on 2 cores for the 353-node ResNet-50 benchmark graph.'),
    ('`acg`',
     'Feng & Huang, *Optimal Gradient Checkpoint Search for Arbitrary Computation Graphs* (CVPR 2021)',
     'Division tree of independent segments and Algorithms 1-6. `mode = "memory"`: the paper\'s '
     'memory-optimal checkpoints (eq. 2); default `mode = "budget"`: the least recomputation whose '
     "simulated peak fits the budget over ACG's family of checkpoint sets (each re-forwarded once), "
     'exact when the family has at most `exact_limit` = 4096 sets (tested against a brute force); '
     "larger families get a Lagrangian relaxation over the paper's recursion, a heuristic whose "
     'schedule fits the budget and recomputes no more than the memory-optimal set when that fits, but'
     ' is not always the cheapest.'),
    ('`moccasin`',
     'Bartan et al., *MOCCASIN* (ICML 2023)',
     'Retention intervals on OR-tools CP-SAT: each node computed at most `max_copies` times, each '
     "copy's output live on one interval, precedence by interval cover, memory by one cumulative "
     'constraint; the same frontier-advancing slots as Checkmate, so with enough copies its optimum '
     "is Checkmate's. Two phases as in the paper: lower the peak to the budget, then minimize cost; "
     "phase 1 is skipped when the insertion greedy's schedule (`tasks/solve/core/peak_insertion.py`, "
     'made frontier-advancing) fits. Random layered graphs at 0.8, 300 s, 1 thread: n250 1.016x, n500'
     ' 1.037x, n1000 1.024x sum(cost) (`bench/random_layered.py`).'),
    ('`hierarchical`',
     'Zhao et al., *Rockmate* (ICML 2023)',
     'Cuts the step into a chain of blocks (articulation points of the forward graph, after pinning '
     'values read across more than a quarter of it, such as attention masks, and module boundaries '
     'recorded at capture), solves each distinct block once for a ladder of retention and peak limits'
     ' with Checkmate\'s MILP plus a retention constraint (`inner = "checkmate"`, with the time-saving'
     ' variant families fixed as `dtr` fixes them; `inner = "monet"`: MONeT\'s program, which also '
     'picks implementation variants), seeded by retention-greedy options that recompute the cheapest '
     "bytes first, and picks one option per block by a dynamic program over the chain, or by Rotor's "
     'nested program where a block boundary is recomputed from an earlier one; the simulator checks '
     'the composed schedule. `bench/peers.py`, `bench/planning_time.py`. When to use it: on a step of '
     'repeated blocks, where a few percent less memory is worth several times the planning time. On a '
     "207-node GPT-2 its `max_overhead = 0.1` plan peaked 2.2% below `dtr`'s at 4.3x `dtr`'s search time "
     "(docs/measurements/planning-time.md). Issue #55's runs saw it return `dtr`'s schedule, or one within 0.1% of "
     'its cost, at 10-90x the time. It is in no default plan: every solve of it also runs the cheap solvers, '
     '`dtr` among them.'),
    ('`monet`, `monet-noop`',
     'Shah et al., *Memory Optimization for Deep Networks* (MONeT, ICLR 2021)',
     "The paper's 0-1 program (sec. 4, appendices B-C) on the joint operator graph: the forward pass "
     'once, then before each backward node recomputations in forward order; `monet` also picks every '
     "step's implementation variant (e.g. ReLU masks), `monet-noop` checkpoints only. Exact on its "
     'schedule space (brute-force checked); warm-started from checkpoint-all when it fits, else '
     "(`monet` with variants) from `monet-noop`'s answer, so it never ends worse than `monet-noop`, "
     "else from `hierarchical`'s schedule, else `ap-greedy`'s (the first in MONeT's space). Also the "
     'inner solver of `hierarchical` (`inner = "monet"`) for real models; `bench/monet.py` against '
     'Checkmate, torch.compile and hand checkpointing, with the Fig. 4 ablation: docs/measurements/monet-cpu.md.'),
    ('`checkpoint-all`, `chen-sqrt-n`, `chen-greedy`, `griewank-log-n`, `ap-sqrt-n`, `ap-greedy`, '
     '`linearized-sqrt-n`, `linearized-greedy`',
     'Checkmate table 1 and appendix B (Chen et al. 2016, Griewank & Walther 2000)',
     'The classic checkpointing baselines. The segment ones recompute each segment once before its '
     'backward and keep it until its backward is done, as `torch.utils.checkpoint` does: at most one '
     'extra forward.'),
    ('`module-checkpoint`',
     '`torch.utils.checkpoint` (what users write by hand)',
     'Checkpoints every n-th repeated module (transformer layer, residual block) recorded at capture '
     "(`runtime/tracing/modules.py`): keeps each group's output and everything outside the modules, "
     'recomputes each group once before its backward; `every = 0` picks the cheapest n that fits.'),
    ('`remat-greedy`',
     '-',
     'A fast memory- and cost-aware greedy; the MIP start of `checkmate` when `dtr` finds none.'),
    ('`dtr`',
     'Kirisame et al., *Dynamic Tensor Rematerialization* (ICLR 2021), sec. 4',
     "DTR's online eviction run offline over the order: evict the value of least h = (cost + "
     'evicted-neighbourhood cost) / (bytes x staleness) (h_DTR^eq, h_DTR^local, and an offline '
     'lookahead / next-use variant), recompute evicted inputs recursively; several walks (also over '
     "moccasin's low-peak order), the cheapest simulated one kept; before them, from each order, a "
     'peak-directed recomputation insertion greedy (`tasks/solve/core/peak_insertion.py`: at the '
     'peak, recompute the live value with the best excess drop per cost just before its next read). '
     'Where the graph offers implementation variants, all of this runs once more per choice of the '
     'memory-saving variant families fixed on every node (`tasks/solve/core/fixed_variants.py`: e.g. '
     'ReLU6 bit masks and output-activated BatchNorm on MobileNet-V2, whose checkpoint-all peak they '
     'lower to 0.68x; as profiled on this CPU they add 36-61% to its step, more than the '
     'recomputation they save, so there the choice without variants wins and the others are skipped).'
     ' Seconds; the default MIP start of `checkmate` and one of the cheap solvers below. Within 3% of'
     ' sum(cost) (a lower bound) on every `*_train` benchmark graph at 0.9 and 0.8 (ResNet-50 in 2 s,'
     ' remat-greedy 17-46 s); on the random layered graphs n100-n1000 within 0.8% at 0.9 and within '
     '3.2% at 0.8 (n1000 at 0.8: 1.024x, first schedule in 5 s, 36 s in all; '
     '`bench/random_layered.py`).'),
    ('`olla`',
     'Steiner et al., *OLLA* (2022), sec. 3-4',
     'The operator order of the whole step that minimizes the peak, no recomputation: the lifetime '
     'ILP (eq. 1-5, 13-14) with ASAP/ALAP spans and useful lifetimes (eq. 10-12), zero-byte control '
     'edges keeping random ops in their eager order, started from a window search that solves the '
     'same ILP on 16-step windows around the peak (HiGHS needs minutes for the whole graph). '
     'Addresses for any plan: `addresses = "olla"` (location ILP, eq. 6-8 and 15, with the pyramid of'
     ' Function 5 and greedy as start and fallback). `bench/olla.py` (CPU, 30 s per ILP, simulated = '
     "measured peaks; the search starts from the better of PyTorch's order and a greedy memory "
     "order): OLLA's order / PyTorch's at batch 1 and 32: resnet18 0.978 / 0.627, mobilenet_v2 0.668 "
     '/ 0.998, 2-layer GPT-2 0.921 / 1.000 (mean 0.856 / 0.875; paper: 0.775 / 0.899); fragmentation '
     '0% for the copies arena mode places; the whole-graph ILP hits its time limit on all six.'),
)
"""Per solver (or group of solvers): the paper and what the implementation does, with measurements."""

VARIANTS = (
    "Implementation variants (MONeT's operator implementations): a `Problem` carries each node's "
    'variants (time, workspace, values read and allocated, profiled per variant: ReLU / ReLU6 '
    'backward from a 1-byte or a bit-packed mask, BatchNorm / LayerNorm backward from the output, '
    'max-pool with 1-byte window indices, CPU attention by the math backend (grouped-query heads '
    'included), ReLU forward in place where nothing else reads its input (no arena address for those '
    'copies), a tanh computed as `2 sigmoid(2z) - 1` (time only: 2.4x faster on this CPU, within '
    '2.5e-7, so `dtr` runs it where the profile finds it at least 5% faster); the profile compares '
    'each variant bit for bit with the default on its device and drops one that fails on a node, with'
    ' a warning; a plan\'s `variants` setting (`"all"`, `"bit-identical"`: only variants found exact, '
    '`"none"`; `memplan solve --variants`) limits what the solver may choose; convolution backward is'
    ' split into weight- and input-gradient nodes at capture (grouped ones on CPU graphs only: CUDA '
    'rounds their halves differently), a language model\'s head and cross-entropy whose logits take 64'
    ' MiB or more chunked into ops that hold no logits-sized tensor (the logits computed again in the '
    'backward; another summation order, checked within the validation tolerance), cross-entropy fused '
    'into ops that hold one logits-sized tensor'
    " where the captured loss held three, the written-out tanh GELU (transformers' `gelu_new`) fused "
    'into ops whose backward keeps two of the four tensors it kept (both fusions on CPU graphs only: '
    'on a GPU their blockwise kernels cost more time than they save memory), and the key/value '
    "cache's copies of keys and values dropped, each rewrite instance applied only where the trace "
    'stage finds it bit-identical (the chunked loss: within tolerance) on the profiling device '
    '(docs/graph-format.md); '
    'docs/plan-format.md), the simulator charges the variant each step names, and a plan can carry an'
    ' arena address for every value copy (`--addresses greedy` or `addresses = "greedy"`: largest '
    "first, best gap; `olla`: OLLA's location ILP), which `runtime.load(plan, model, loss_fn, "
    'arena=True)` runs from one preallocated arena (docs/plan-format.md).'
)
"""What the solvers plan besides the schedule: implementation variants and arena addresses."""


def catalogue() -> str:
    """docs/solvers.md: the papers and what each solver does, the variants and addresses they plan, and every
    registered solver's summary and options."""
    lines = ["# Solvers", "",
             "Generated from the registry (`tasks.solve.SOLVERS`) by `python -m memplan.tasks.solve > docs/solvers.md`;",
             "a test keeps this file equal to the registry. Options go in `[[plans]] options = { ... }` of",
             "pipeline.toml or `memplan solve --option KEY=VALUE` (values as in TOML). Every solver also takes",
             "the shared `backend`, `time_limit_s` and `gap` (docs/config.md).", "",
             "## Papers", "", "| solver | paper | what it does |", "|---|---|---|"]
    lines += [f"| {solvers} | {paper} | {what} |" for solvers, paper, what in PAPERS]
    lines += ["", "## Implementation variants and addresses", "", VARIANTS, ""]
    for spec in SOLVERS.values():
        lines += [f"## `{spec.name}`", "", spec.summary[0].upper() + spec.summary[1:]
                  + (" Chooses implementation variants." if spec.variants else "")
                  + (" Its schedules run in the policy form (`runtime.apply`): a pipeline plan of it takes that form "
                     "unless `form = \"executor\"`." if spec.policy_form else "")
                  + (f" Never returns a schedule costlier than {', '.join(CHEAP)} find at the same budget, their "
                     f"implementation variants counted (the report's `source` names the winner)." if spec.portfolio else ""), ""]
        options = describe_options(spec)
        if options:
            lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
            lines += [f"| `{o.name}` | {o.type} | `{o.default!r}` | {o.help} |" for o in options]
        else:
            lines.append("No options.")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(catalogue(), end="")
