#!/usr/bin/env bash
# The fresh-machine check: clone this repository's HEAD into an empty folder, run the README's two set-up
# commands there exactly as written (main job, then tests), run the main job once more on its warm caches,
# and print the wall time of every part of each command and every failed plan cell and test.
#
# usage: bench/fresh_clone.sh [--no-pip-cache] [--keep] [--ref REF]
#   --no-pip-cache  install with pip's cache off (PIP_NO_CACHE_DIR=1), as on a machine that never ran pip
#   --keep          keep the clone (its path is printed); by default it is removed unless something failed
#   --ref REF       clone REF instead of HEAD
# Exit status: 0 when every command succeeded, 1 otherwise. Logs: <clone>/.fresh-logs/.
set -uo pipefail

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel) || exit 2
ref=HEAD keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --no-pip-cache) export PIP_NO_CACHE_DIR=1 ;;
        --keep) keep=1 ;;
        --ref) ref=${2:?--ref needs a value}; shift ;;
        *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    esac
    shift
done

work=$(mktemp -d) || exit 2
clone="$work/memplan"
git clone -q --no-hardlinks "$repo" "$clone" && git -C "$clone" checkout -q --detach "$(git -C "$repo" rev-parse "$ref")" || exit 2
logs="$clone/.fresh-logs"
mkdir -p "$logs"
echo ".fresh-logs/" >> "$clone/.git/info/exclude"
cd "$clone" || exit 2

# The two commands of the README's "Set up" section: the first bash block runs the main job, the second the tests.
mapfile -t commands < <(awk '/^## Set up/{s=1} s&&/^## /&&!/^## Set up/{exit} s&&/^```bash/{b=1;next} b&&/^```/{b=0;next} b' README.md)
if [ "${#commands[@]}" -ne 2 ]; then
    echo "README.md's Set up section should hold exactly two bash commands; found ${#commands[@]}." >&2
    exit 1
fi
cached_run=$(printf '%s\n' "${commands[0]}" | awk -F' && ' '{print $NF}')

failed=0
summary=()
run_parts() {            # run_parts LABEL COMMAND: each `&&` part timed on its own, stopping at the first failure
    local label=$1 command=$2 part rc start seconds i=0
    IFS=$'\n' read -r -d '' -a parts < <(printf '%s' "$command" | sed 's/ && /\n/g'; printf '\0')
    for part in "${parts[@]}"; do
        i=$((i + 1))
        start=$(date +%s.%N)
        bash -c "$part" > "$logs/$label.$i.log" 2>&1
        rc=$?
        seconds=$(echo "$(date +%s.%N) - $start" | bc)
        summary+=("$(printf '%-12s %8.1f s  exit %-3s %s' "$label" "$seconds" "$rc" "$part")")
        if [ "$rc" -ne 0 ]; then
            failed=1
            return "$rc"
        fi
    done
}

echo "fresh clone of $(git -C "$repo" rev-parse --short "$ref") in $clone (pip cache: ${PIP_NO_CACHE_DIR:+off}${PIP_NO_CACHE_DIR:-on})"
run_parts main "${commands[0]}"
[ "$failed" -eq 0 ] && run_parts main-cached "$cached_run"
run_parts tests "${commands[1]}"

echo
printf '%-12s %10s  %-8s %s\n' "command" "wall" "status" "part"
printf '%s\n' "${summary[@]}"

echo
echo "failed plan cells (main job):"
grep -hE '\b(rejected|infeasible|failed|Error)\b' "$logs"/main.*.log "$logs"/main-cached.*.log 2>/dev/null \
    | grep -vE '^\s*$' | sed 's/^/  /' | head -40 || true
echo "failed tests:"
grep -hE '^(FAILED|ERROR) ' "$logs"/tests.*.log 2>/dev/null | sed 's/^/  /' | head -60 || true
grep -hE '^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed)' "$logs"/tests.*.log 2>/dev/null | tail -1 | sed 's/^/tests: /'

if [ "$failed" -ne 0 ] || [ "$keep" -eq 1 ]; then
    echo "clone kept: $clone (logs in $logs)"
else
    rm -rf "$work"
fi
exit "$failed"
