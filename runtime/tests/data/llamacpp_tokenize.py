"""Regenerates gemma3_llamacpp_tokens.json: llama.cpp's token ids for the texts in it.
usage: e2e/.venv-bench/bin/python runtime/tests/data/llamacpp_tokenize.py MODEL.gguf FIXTURE.json
(the venv is e2e/bench/generation.sh's, with llama-cpp-python 0.3.36)."""
import json
import sys

from llama_cpp import Llama

model, fixture = sys.argv[1], sys.argv[2]
m = Llama(model_path=model, vocab_only=True, verbose=False)
data = json.load(open(fixture))
for case in data["cases"]:
    case["ids"] = m.tokenize(case["text"].encode(), add_bos=False, special=True)
lines = ["{", "  \"generated_by\": " + json.dumps(data["generated_by"]) + ",", "  \"cases\": ["]
lines += ["    " + json.dumps(c, ensure_ascii=False) + ("," if i < len(data["cases"]) - 1 else "")
          for i, c in enumerate(data["cases"])]
lines += ["  ]", "}"]
open(fixture, "w").write("\n".join(lines) + "\n")
