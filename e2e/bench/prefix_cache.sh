#!/usr/bin/env bash
# Prefix-cache benchmark: time to first token for a 1,500-token shared system prompt plus a
# 20-token user turn, cold vs cached, Bulkhead beside llama.cpp's prompt reuse on the same
# GGUF, the same prompts and thread count, interleaved per thread count. Not a test.
# usage: e2e/bench/prefix_cache.sh            (installs llama-cpp-python into e2e/.venv-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=e2e/.venv-bench
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # llama-cpp-python builds llama.cpp from source (about 15 minutes on 2 cores).
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install -q llama-cpp-python==0.3.36 numpy
fi
model="${BULKHEAD_MODELS:-$HOME/.cache/bulkhead/models}/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo test --no-run --workspace --bench prefix_cache 2>/dev/null
prompts=$(mktemp)
out=$(mktemp)
for threads in 1 2; do
  RAYON_NUM_THREADS=$threads PREFIX_BENCH_PROMPTS=$prompts \
    cargo test --quiet --workspace --bench prefix_cache -- --bench 2>/dev/null | tail -1 >>"$out"
  "$venv/bin/python" e2e/bench/llamacpp_prefix.py "$model" "$threads" "$prompts" 2>/dev/null \
    | tail -1 >>"$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'engine':<10} {'threads':>7} {'prompt':>7} {'cached':>7} {'cold TTFT ms':>13} "
      f"{'cached TTFT ms':>15} {'speedup':>8}")
for r in rows:
    print(f"{r['engine']:<10} {r['threads']:>7} {r['prompt_tokens']:>7} "
          f"{r.get('cached_tokens', '-'):>7} {r['cold_ttft_ms']:>13.1f} "
          f"{r['cached_ttft_ms']:>15.1f} {r['speedup']:>7.1f}x")
PY
