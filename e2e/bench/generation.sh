#!/usr/bin/env bash
# Side-by-side generation benchmark: Bulkhead vs llama.cpp on the same GGUF and thread count,
# interleaved per thread count so both see the same machine load. Not a test.
# usage: e2e/bench/generation.sh [smollm2|gemma3]   (installs llama-cpp-python into e2e/.venv-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=e2e/.venv-bench
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # llama-cpp-python builds llama.cpp from source (about 15 minutes on 2 cores).
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install -q llama-cpp-python==0.3.36 numpy
fi
models="${BULKHEAD_MODELS:-$HOME/.cache/bulkhead/models}"
case "${1:-smollm2}" in
  smollm2) model="$models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"; formats="q8_0 native" ;;
  # native: the Q4_K and Q6_K matrices on the K-quant kernels as stored; q8_0: re-quantized.
  gemma3) model="$models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"; formats="q8_0 native" ;;
  *) echo "usage: $0 [smollm2|gemma3]" >&2; exit 2 ;;
esac
export BENCH_MODEL="${1:-smollm2}"
# The dev profile (opt-level 3 for every crate, see Cargo.toml) runs the bench binary, so
# this reuses the test build instead of a separate release build; `--bench` makes it
# measure. The bench fetches the models itself, and runs before llama.cpp needs the file.
bench() { cargo test --quiet --workspace --bench generation -- --bench; }
cargo test --no-run --workspace --bench generation 2>/dev/null
out=$(mktemp)
for threads in 1 2; do
  for weights in $formats; do
    row=$(RAYON_NUM_THREADS=$threads CANDLE_NUM_THREADS=$threads BENCH_WEIGHTS=$weights \
      bench 2>/dev/null | tail -1)
    echo "$row" >>"$out"
    # Where the matmuls ran on AMX tiles, the same run on the AVX-512 kernels beside it.
    if [ "$weights" = native ] && [[ "$row" == *'"matmul":"AMX"'* ]]; then
      BULKHEAD_CPU_AMX=off RAYON_NUM_THREADS=$threads CANDLE_NUM_THREADS=$threads \
        BENCH_WEIGHTS=$weights bench 2>/dev/null | tail -1 >>"$out"
    fi
  done
  # llama.cpp's AMX path can segfault (see llamacpp_generation.py); then measure it without.
  if ! llama=$("$venv/bin/python" e2e/bench/llamacpp_generation.py "$model" "$threads" 2>/dev/null); then
    llama=$("$venv/bin/python" e2e/bench/llamacpp_generation.py "$model" "$threads" --no-extra-bufts 2>/dev/null)
  fi
  echo "$llama" | tail -1 >>"$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cols = ["prefill_tok_s", "decode_1_tok_s", "decode_4_tok_s", "decode_16_tok_s"]
print(f"{'engine':<10} {'weights':<18} {'matmul':<8} {'threads':>7} "
      + " ".join(f"{c:>16}" for c in cols) + f" {'16/1':>6}")
for r in rows:
    ratio = r["decode_16_tok_s"] / r["decode_1_tok_s"] if r["decode_1_tok_s"] else 0.0
    print(f"{r['engine']:<10} {r['weights']:<18} {r.get('matmul', '-'):<8} {r['threads']:>7} "
          + " ".join(f"{r[c]:>16.1f}" for c in cols) + f" {ratio:>5.1f}x")
PY
