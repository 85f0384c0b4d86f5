"""Regenerates gpu-engine/tests/fixtures/smollm2_greedy.json: llama.cpp's greedy continuation
(first 8 tokens) of the test prompts, with the top-2 logit margin at each step (near-ties may
flip between implementations: llama.cpp quantises activations when it multiplies by quantised
weights). CI compares against the stored file and needs no llama.cpp.

    /tmp/llama/bin/python scripts/gen-model-fixtures.py "$(bash scripts/fetch-model.sh)"
"""
import json
import sys

import llama_cpp
import numpy as np

path = sys.argv[1]
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, logits_all=True, verbose=False, n_threads=2, n_batch=512)
chat = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "plain": "The capital of France is",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "chat": chat,
    "long": ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
             "told stories about the stars. Every evening the children gathered around him. ") * 6 + "One night he said",
}
out = {"generator": "llama-cpp-python %s" % llama_cpp.__version__, "cases": []}
for name, text in PROMPTS.items():
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    gen, margins = [], []
    for _ in range(8):
        logits = np.array(llm.scores[llm.n_tokens - 1])
        top = np.argsort(logits)[::-1][:2]
        gen.append(int(top[0]))
        margins.append(float(logits[top[0]] - logits[top[1]]))
        llm.eval([int(top[0])])
    # llama.cpp's batched path (all tokens in one eval, as a teacher-forced check runs) rounds
    # differently from its one-token path; record that margin too: a position is a near-tie
    # when either path says so.
    llm.reset()
    llm.eval(ids + gen[:-1])
    batched = []
    for i in range(len(gen)):
        logits = np.array(llm.scores[len(ids) - 1 + i])
        top = np.sort(logits)[::-1][:2]
        batched.append(float(top[0] - top[1]))
    out["cases"].append({"name": name, "prompt_ids": ids, "greedy": gen, "margins": margins, "margins_batched": batched})
with open("gpu-engine/tests/fixtures/smollm2_greedy.json", "w") as f:
    json.dump(out, f, indent=1)
print("wrote", len(out["cases"]), "cases")
