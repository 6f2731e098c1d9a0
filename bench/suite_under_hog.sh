#!/usr/bin/env bash
# Issue 13 capability 9: the whole suite N times in a row, in a fresh clone of COMMIT, with a CPU hog (a busy
# loop) pinned to core 1 for the whole sequence. Each run takes the machine-wide bench lock, so a benchmark
# may run between two runs (pause the hog with kill -STOP meanwhile).
# `make test` runs two tiers (tests/conftest.py), so the summary keeps both tiers' result lines.
# Usage: bench/suite_under_hog.sh COMMIT [N=3] [LOGDIR=/tmp/hoglogs]; results in LOGDIR/summary.txt
set -u
commit=$1; n=${2:-3}; logs=${3:-/tmp/hoglogs}
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d /tmp/hogrun.XXXXXX)
mkdir -p "$logs"
git clone -q "$repo" "$dir" && cd "$dir" && git checkout -q "$commit" || exit 1
make venv > "$logs/venv.log" 2>&1 || exit 1
taskset -c 1 sh -c 'while :; do :; done' & hog=$!
trap 'kill $hog; rm -rf "$dir"' EXIT
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  flock -w 3600 /tmp/tandem-bench.lock make test > "$logs/run$i.log" 2>&1
  rc=$?
  echo "run $i on $commit: rc=$rc in $(( $(date +%s) - start )) s: $(grep -E '^[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$logs/run$i.log" | tr '\n' ' ')" >> "$logs/summary.txt"
done
