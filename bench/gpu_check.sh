#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (no Ray, no package index there):
#   1. tests/test_cuda.py: the engine on CUDA against HF on the same GPU (fp32 greedy, chunked prefill,
#      prefix cache, preemption), dtype auto = bfloat16, layer-wise progress from CUDA events, KV pulled
#      over gRPC between two CUDA caches, whole and layer-wise;
#   2. bench/offline.py on the GPU: the engine against HF generate, bf16 and fp32, on a random-weight
#      model of SmolLM2-135M's shape (its weights do not travel; its tokenizer does);
#   3. bench/step_profile.py: a 256-sequence decode step under cProfile and torch.profiler;
#   4. bench/transfer.py's gRPC cases, with the CUDA-cache case.
# Usage (repository root): bench/gpu_check.sh OUT_DIR TOKENIZER_DIR
#   TOKENIZER_DIR holds the default model's tokenizer files (tokenizer.json, tokenizer_config.json, ...);
#   carried wheels in .whl/ (what the machine's image lacks or has too old: llguidance, grpcio, protobuf)
#   are installed first; SKIP_TRANSFER=1 leaves out step 4.
set -uo pipefail
out=${1:?OUT_DIR}
tok=${2:?TOKENIZER_DIR}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
# build_random_model takes the default model's tokenizer: a cache entry with the tokenizer and no weights.
model_cache=$TANDEM_CACHE_DIR/models/smollm2-135m-instruct
mkdir -p "$model_cache" && cp "$tok"/* "$model_cache"/ && touch "$model_cache/model.safetensors"
nvidia-smi -L
python3 -c 'import torch, transformers, grpc, google.protobuf as pb; print("torch", torch.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__, "protobuf", pb.__version__, "cuda", torch.cuda.is_available())'

echo "== tests/test_cuda.py"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 | tee "$out/test_cuda.log"
tests_rc=${PIPESTATUS[0]}

echo "== bench/offline.py on the GPU"
python3 - <<'PY'
from engine.model_loader import build_random_model
build_random_model("/tmp/smol-shaped", "llama", seed=0, hidden_size=576, num_layers=30, num_heads=9,
                   num_kv_heads=3, max_position_embeddings=2048)
PY
for run in "bfloat16 64" "bfloat16 256" "float32 64"; do
    set -- $run
    timeout 100 python3 bench/offline.py --device cuda --model /tmp/smol-shaped --dtype $1 --num-requests $2 \
        --prompt-len 128 --output-len 128 --repeat 2 --threads 4 2>&1 | grep -v "Loading weights" \
        | tee -a "$out/offline.log"
done

echo "== bench/step_profile.py: one 256-sequence decode step, host against CUDA time"
timeout 100 python3 bench/step_profile.py --device cuda --dtype bfloat16 --num-requests 256 --steps 10 2>&1 \
    | grep -v -e "Loading weights" -e "Writing model" > "$out/step_profile.log"
head -1 "$out/step_profile.log"

if [ -z "${SKIP_TRANSFER:-}" ]; then
    echo "== bench/transfer.py (gRPC cases)"
    timeout 150 python3 bench/transfer.py --only "gRPC" --repeats 10 2>&1 | tee "$out/transfer.log"
fi
echo "tests rc $tests_rc"
exit $tests_rc
