#!/usr/bin/env bash
# One fresh `tandem serve` (bf16, README defaults plus SERVE_ARGS), a warm-up, then one random workload
# (IN-token prompts, 64 out, N requests at RATE req/s, SEED) with the CPU seconds of every process around it,
# and the served prefill forwards, queue, TTFT and ITL (bench/served_forwards.py). Traffic to 127.0.0.1 only.
#   SERVE_ARGS="--config my.yaml" RATE=1 N=32 bench/served_cpu.sh [out-dir]
# Take /tmp/tandem-bench.lock around it when other benchmarks may run.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python; port=${PORT:-18100}; out=${1:-/tmp/served-cpu}; mkdir -p "$out"
( exec $py -m cluster.cli serve --port $port --dtype ${DTYPE:-bfloat16} ${SERVE_ARGS:-} ) > "$out/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
workload() { $py bench/serve.py --base-url http://127.0.0.1:$port --dataset random --random-input-len ${IN:-256} \
  --random-output-len 64 --request-rate ${RATE:-1.0} "$@"; }
snap() { for p in /proc/[0-9]*; do s=$(cat $p/stat 2>/dev/null) || continue; rest=${s##*) }; set -- $rest
  echo "${p#/proc/} $((${12}+${13})) $(tr '\0' ' ' < $p/cmdline 2>/dev/null | cut -c1-80)"; done; }
workload --num-prompts 8 --seed $(( ${SEED:-301} - 1 )) > "$out/warm.txt" 2>&1
snap > "$out/cpu-before.txt"
workload --num-prompts ${N:-32} --seed ${SEED:-301} --tandem-trace --result-dir "$out" > "$out/serve.txt" 2>&1
snap > "$out/cpu-after.txt"
curl -s http://127.0.0.1:$port/metrics | grep -E "^tandem:cpu_(busy_lends|busy_lent_seconds|reclaim_timeouts)_total" || true
$py - "$out" <<'PY'
import sys
def load(f):
    rows = {}
    for line in open(f):
        pid, ticks, *cmd = line.rstrip("\n").split(" ", 2)
        rows[pid] = (int(ticks), cmd[0] if cmd else "")
    return rows
before, after = load(f"{sys.argv[1]}/cpu-before.txt"), load(f"{sys.argv[1]}/cpu-after.txt")
deltas = sorted(((t - before.get(pid, (0,))[0]) / 100, cmd) for pid, (t, cmd) in after.items())[::-1]
print("CPU seconds during the workload:", "; ".join(f"{s:.1f} {c.strip()[:40]}" for s, c in deltas[:8] if s > 0))
PY
$py bench/served_forwards.py "$out"/*/serve.json
