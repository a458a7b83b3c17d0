"""Which profile store and plans folder a reading command (`query`, `profiles list`, `plans`, `solve`) means.

In order: `--store` / `--plans` (`--dir`) as given (a missing store folder is an error; a missing plans
folder has no plans yet); else the pipeline
file given with `--config`, or `./pipeline.toml` when there is one (its `store` and `publish.dir`, from
the file's folder: what `memplan run` here writes); else `$MEMPLAN_PROFILES_DB` for the store; else
`./profiles_db` and `./plans`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

ConfigOption = Annotated[Optional[Path], typer.Option(
    "--config", help="Read the store and plans folder of this pipeline file \\[default: ./pipeline.toml if present].",
    show_default=False)]
DEFAULT_CONFIG = Path("pipeline.toml")


@dataclass(frozen=True)
class Locations:
    """The folders a command reads and where each choice came from (said on stderr)."""

    store: Path | str      # a folder, or a store URL (s3://bucket/prefix) as given
    plans: Path
    store_from: str
    plans_from: str

    def say(self, store: bool = True, plans: bool = True) -> None:
        """One line on stderr naming the folders read."""
        from memplan.flows.console import errors

        parts = ([f"profile store {self.store} ({self.store_from})"] if store else []) + \
                ([f"plans {self.plans} ({self.plans_from})"] if plans else [])
        errors().print("reading " + ", ".join(parts), style="dim", markup=False, highlight=False)


def _store(location: str | Path) -> Path | str:
    """A store location: a URL as given, a folder as an absolute path."""
    from memplan.tasks.store.profiles import is_url

    return str(location) if is_url(location) else Path(location).expanduser().resolve()


def _given(path: Path | str, option: str) -> Path | str:
    from memplan.tasks.config import ConfigError
    from memplan.tasks.store.profiles import is_url

    if is_url(path):
        return str(path)
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{option} {path}: no such folder; give an existing {option[2:]} folder, or leave "
                          f"{option} out to use the one of ./pipeline.toml (or --config).")
    return path.resolve()


def locate(config: Path | None = None, store: str | Path | None = None, plans: Path | None = None) -> Locations:
    """The store and plans folders, following the order of this module's docstring."""
    from memplan.tasks.store.profiles import ENV_VAR, store_root

    found = {}
    if store is not None:
        found["store"] = (_given(store, "--store"), "given")
    if plans is not None:
        found["plans"] = (plans.resolve(), "given")
    if len(found) < 2 and (config is not None or DEFAULT_CONFIG.is_file()):
        from memplan.tasks.config import load_config

        path = config if config is not None else DEFAULT_CONFIG
        loaded = load_config(path)
        found.setdefault("store", (_store(loaded.store), f"store of {path}"))
        found.setdefault("plans", (Path(loaded.publish.dir).resolve(), f"publish.dir of {path}"))
    if "store" not in found and os.environ.get(ENV_VAR):
        found["store"] = (_store(os.environ[ENV_VAR]), f"${ENV_VAR}")
    found.setdefault("store", (store_root(), "no pipeline.toml here"))   # $MEMPLAN_PROFILES_DB unset here
    found.setdefault("plans", (Path("plans").resolve(), "no pipeline.toml here"))
    return Locations(found["store"][0], found["plans"][0], found["store"][1], found["plans"][1])
