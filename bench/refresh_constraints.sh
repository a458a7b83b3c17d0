#!/usr/bin/env bash
# Refresh constraints.txt: resolve pyproject.toml's requirements (with the test and fleet extras) afresh in
# an empty virtual environment and write what pip installed. Then run bench/fresh_clone.sh and the suite
# before committing the new file: the constraints are the versions the tests ran with.
# Caps that a fresh resolve must respect (SQLAlchemy < 2.1 for Prefect's scheduler) live in pyproject.toml.
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e "$repo[test]"
{
    head -n 2 "$repo/constraints.txt"
    "$venv/bin/pip" freeze --exclude-editable
} > "$repo/constraints.txt.new"
mv "$repo/constraints.txt.new" "$repo/constraints.txt"
rm -rf "$(dirname "$venv")"
git -C "$repo" diff --stat -- constraints.txt
