#!/bin/bash
# CPU seconds per process while tandem serves 256/64 random prompts at 1.5 req/s (bench/handoff.py, the
# README's defaults), over a 45 s window of the load; with ms of CPU per streamed token.
#
#     bench/serving_cpu.sh [CODE_DIR] [SEED]
#
# CODE_DIR (default: this checkout) runs with this checkout's virtualenv, first on PYTHONPATH, so a
# baseline revision can run from a git worktree (`git worktree add --detach /tmp/base REV`; link .venv).
# Writes bench/results/serving-cpu-<time>/ (handoff output, /proc snapshots). Takes about 2.5 minutes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
CODE=$(cd "${1:-$HERE}" && pwd)
SEED=${2:-4242}
OUT=$HERE/bench/results/serving-cpu-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
cd "$CODE"
PYTHONPATH=$CODE "$HERE/.venv/bin/python" bench/handoff.py --rate 1.5 --requests 90 --seed "$SEED" \
    > "$OUT/handoff.out" 2>&1 &
LOAD=$!
for _ in $(seq 1 300); do grep -q "up on" "$OUT/handoff.out" && break; sleep 1; done
snap() {  # pid, utime+stime in ticks, command line
    for p in $(pgrep -f "ray::|raylet|gcs_server|dashboard|python"); do
        echo "$p $(awk '{print $14+$15}' /proc/"$p"/stat 2>/dev/null) $(tr '\0' ' ' </proc/"$p"/cmdline | cut -c1-60)"
    done
}
sleep 6; snap > "$OUT/cpu0.txt"; T0=$(date +%s.%N)
sleep 45; snap > "$OUT/cpu1.txt"; T1=$(date +%s.%N)
wait $LOAD
python3 - "$OUT" "$T0" "$T1" "$(getconf CLK_TCK)" <<'PY'
import sys
out, t0, t1, hz = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
def read(name):
    rows = (line.split(maxsplit=2) for line in open(f"{out}/{name}"))
    return {r[0]: (int(r[1]), r[2].strip() if len(r) > 2 else "") for r in rows if len(r) > 1 and r[1].isdigit()}
a, b = read("cpu0.txt"), read("cpu1.txt")
window = t1 - t0
tokens = 1.5 * 64 * window  # offered: rate x output tokens x window
print(f"window {window:.1f} s, ~{tokens:.0f} streamed tokens offered")
for cpu, name in sorted((((b[p][0] - a[p][0]) / hz, a[p][1][:50]) for p in a if p in b), reverse=True):
    if cpu > 0.05:
        print(f"{cpu:6.2f} s  {cpu / window * 100:5.1f}% of a core  {cpu / tokens * 1000:5.2f} ms/token  {name}")
PY
grep -E '"(ttft|itl)_(median|p99)_ms"' "$OUT/handoff.out"
