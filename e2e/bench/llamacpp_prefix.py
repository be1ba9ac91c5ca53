"""llama.cpp's prompt reuse (llama-cpp-python's `Llama`, which keeps the KV of the previous
prompt and evaluates only what follows the longest matching prefix) on the same GGUF and the
same prompts as runtime/benches/prefix_cache.rs: median time to the first token, cold (KV
reset before each prompt) and cached (the previous prompt shares the 1,500-token system
prompt). Prints one JSON line.

usage: python llamacpp_prefix.py MODEL.gguf THREADS PROMPTS.json
"""
import json
import statistics
import sys
import time

from llama_cpp import Llama


def main():
    path, threads, prompts_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    prompts = json.load(open(prompts_file))
    llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def ttft(prompt):
        t0 = time.perf_counter()
        llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        return time.perf_counter() - t0

    runs = (len(prompts) - 2) // 2
    llm.reset()
    ttft(prompts[0])  # warm-up
    cold, cached = [], []
    for r in range(runs):
        llm.reset()
        cold.append(ttft(prompts[2 + 2 * r]))
        # The previous prompt is in the KV now: only the new turn is evaluated.
        cached.append(ttft(prompts[3 + 2 * r]))
    tokens = len(llm.tokenize(prompts[0].encode(), add_bos=False, special=True))
    c, h = statistics.median(cold) * 1e3, statistics.median(cached) * 1e3
    print(json.dumps({"engine": "llama.cpp", "threads": threads, "prompt_tokens": tokens,
                      "cold_ttft_ms": c, "cached_ttft_ms": h, "speedup": c / h}))


if __name__ == "__main__":
    main()
