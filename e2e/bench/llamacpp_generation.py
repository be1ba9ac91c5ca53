"""llama.cpp (llama-cpp-python, low-level API) on the same GGUF, the same measurements as
runtime/benches/generation.rs: prompt processing of a 512-token prompt, and aggregate greedy
decode at 1, 4 and 16 concurrent sequences in one batch. Prints one JSON line.

usage: python llamacpp_generation.py MODEL.gguf THREADS [--no-extra-bufts]

--no-extra-bufts loads the weights without llama.cpp's extra CPU buffer types (its AMX and
repacked layouts): its AMX path segfaults in llama_decode on some Sapphire-Rapids-class
machines (ggml-org/llama.cpp#20824), so generation.sh retries with it when the default dies.
"""
import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np

PROMPT_TOKENS = 512
DECODE_TOKENS = 64
FILLER = "The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 64


def main():
    path, threads = sys.argv[1], int(sys.argv[2])
    extra_bufts = "--no-extra-bufts" not in sys.argv[3:]
    L.llama_backend_init()
    L.llama_log_set(ctypes.cast(0, L.llama_log_callback), ctypes.c_void_p(0)) if hasattr(L, "llama_log_set") else None
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = extra_bufts
    model = L.llama_model_load_from_file(path.encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    cp = L.llama_context_default_params()
    cp.n_ctx = 16 * 1024
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_seq_max = 16
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)

    buf = (L.llama_token * 4096)()
    text = FILLER.encode()
    n = L.llama_tokenize(vocab, text, len(text), buf, 4096, False, True)
    ids = list(buf[:n])

    def clear():
        if hasattr(L, "llama_memory_clear"):
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
        else:
            L.llama_kv_self_clear(ctx)

    batch = L.llama_batch_init(512, 0, 16)

    def decode(entries):
        """entries: (token, pos, seq, want_logits)"""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if want else 0
        rc = L.llama_decode(ctx, batch)
        assert rc == 0, rc

    def argmax(i):
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    # warm-up
    clear()
    decode([(t, p, 0, p == 31) for p, t in enumerate(ids[:32])])

    prefill_best = 0.0
    for _ in range(3):
        clear()
        prompt = ids[:PROMPT_TOKENS]
        t0 = time.perf_counter()
        decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        argmax(len(prompt) - 1)
        prefill_best = max(prefill_best, len(prompt) / (time.perf_counter() - t0))

    # The file's own quantization, as llama.cpp names it (e.g. "Q4_1", "Q4_K - Medium").
    buf = ctypes.create_string_buffer(128)
    L.llama_model_desc(model, buf, len(buf))
    quant = buf.value.decode().split(" ", 2)[-1]
    weights = f"{quant} (native)" if extra_bufts else f"{quant} (no x-bufts)"
    result = {"engine": "llama.cpp", "weights": weights, "threads": str(threads),
              "prompt_tokens": PROMPT_TOKENS, "prefill_tok_s": prefill_best}
    short = ids[:32]
    for streams in (1, 4, 16):
        best = 0.0
        for _ in range(2):
            clear()
            entries = [(t, p, s, p == len(short) - 1) for s in range(streams) for p, t in enumerate(short)]
            decode(entries)
            nxt = [argmax(s * len(short) + len(short) - 1) for s in range(streams)]
            pos = len(short)
            t0 = time.perf_counter()
            for _ in range(DECODE_TOKENS):
                decode([(nxt[s], pos, s, True) for s in range(streams)])
                nxt = [argmax(s) for s in range(streams)]
                pos += 1
            best = max(best, streams * DECODE_TOKENS / (time.perf_counter() - t0))
        result[f"decode_{streams}_tok_s"] = best
    print(json.dumps(result))


if __name__ == "__main__":
    main()
