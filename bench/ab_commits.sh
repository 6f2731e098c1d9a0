#!/usr/bin/env bash
# Two commits side by side on the hot paths: the offline engine (bench/offline.py --skip-hf) and serving
# (`tandem serve` on the default model, a fresh server per run, loaded by bench/serve.py), the runs of BEFORE
# and AFTER alternating so both see the same machine load. For a change that must not slow anything down
# (a refactor): compare the two columns, not the absolute figures.
# Usage: flock /tmp/tandem-bench.lock bench/ab_commits.sh BEFORE AFTER [ROUNDS=2] [OUT=/tmp/ab]
# Each commit is checked out as a temporary git worktree and run with this checkout's .venv.
set -u
before=$1; after=$2; rounds=${3:-2}; out=${4:-/tmp/ab}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=$repo/.venv/bin/python
port=18000
mkdir -p "$out"
trees=$(mktemp -d /tmp/abtrees.XXXXXX)
git -C "$repo" worktree add -q --detach "$trees/before" "$before" && git -C "$repo" worktree add -q --detach "$trees/after" "$after" || exit 1
trap 'git -C "$repo" worktree remove --force "$trees/before"; git -C "$repo" worktree remove --force "$trees/after"; rm -rf "$trees"' EXIT

offline() {  # label round
  (cd "$trees/$1" && PYTHONPATH=$PWD "$py" bench/offline.py --skip-hf --seed $((100 + $2)) --repeat 1) \
    > "$out/offline-$1-$2.txt" 2>&1
  echo "offline $1 round $2: $(grep -A1 '^round' "$out/offline-$1-$2.txt" | tail -1)"
}

serving() {  # label round
  (cd "$trees/$1" && PYTHONPATH=$PWD exec "$py" -m cluster.cli serve --port $port) > "$out/server-$1-$2.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  (cd "$repo" && "$py" bench/serve.py --base-url "http://127.0.0.1:$port" --dataset random --random-input-len 256 \
     --random-output-len 64 --num-prompts 32 --request-rate 1.0 --seed $((200 + $2))) > "$out/serve-$1-$2.txt" 2>&1
  kill -INT $server; wait $server
  echo "serving $1 round $2: $(grep -E 'Request throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL|Failed' \
    "$out/serve-$1-$2.txt" | tr -s ' ' | tr '\n' ';')"
}

for r in $(seq 1 "$rounds"); do offline before "$r"; offline after "$r"; done
for r in $(seq 1 "$rounds"); do serving before "$r"; serving after "$r"; done
