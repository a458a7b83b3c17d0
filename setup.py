"""The `memplan` package: `memplan/` and the checkout's rooms `runtime/`, `tasks/`, `flows/` as its sub-packages
(the rest of the metadata is in pyproject.toml)."""

from setuptools import find_packages, setup

ROOMS = ("runtime", "tasks", "flows")

setup(
    packages=["memplan", *(f"memplan.{name}" for name in find_packages(include=[f"{room}*" for room in ROOMS]))],
    package_dir={"memplan": "memplan", **{f"memplan.{room}": room for room in ROOMS}},
)
