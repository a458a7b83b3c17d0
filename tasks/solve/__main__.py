"""`python -m tasks.solve > docs/solvers.md`: the solver catalogue, generated from the registry."""

from tasks.solve import CHEAP, SOLVERS, describe_options


def catalogue() -> str:
    """docs/solvers.md: every registered solver, its summary and its options."""
    lines = ["# Solvers", "",
             "Generated from the registry (`tasks.solve.SOLVERS`) by `python -m tasks.solve > docs/solvers.md`;",
             "a test keeps this file equal to the registry. Options go in `[[plans]] options = { ... }` of",
             "pipeline.toml or `memplan solve --option KEY=VALUE` (values as in TOML). Every solver also takes",
             "the shared `backend`, `time_limit_s` and `gap` (docs/config.md).", ""]
    for spec in SOLVERS.values():
        lines += [f"## `{spec.name}`", "", spec.summary[0].upper() + spec.summary[1:]
                  + (" Chooses implementation variants." if spec.variants else "")
                  + (f" Never returns a schedule costlier than {', '.join(CHEAP)} find at the same budget (the "
                     f"report's `source` names the winner)." if spec.portfolio else ""), ""]
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
