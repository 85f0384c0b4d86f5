"""Regenerates gpu-engine/tests/fixtures/smollm2_tokens.json: llama.cpp's token ids (through
llama-cpp-python 0.3.36, an independent implementation) for the test prompts, and jinja2's
rendering of the model's chat template. CI compares against the stored file and needs neither.

    python3 -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python==0.3.36
    /tmp/llama/bin/python scripts/gen-token-fixtures.py "$(bash scripts/fetch-model.sh)"
"""
import json
import sys

import jinja2
import llama_cpp

PROMPTS = [
    "Hello, world! This is a plain sentence.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "In 2024 we sold 12345 apples at 3.75 each (total: 46293.75).",
    "héllo wörld — 你好, мир 🙂 café",
    "I'm sure they'll say we've done what we can't.",
    "   leading spaces\tand tabs\n\nand blank lines  \n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. " * 40,
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to 3."},
     {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "Again, in words."}],
]

path = sys.argv[1]
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
template = llm.metadata["tokenizer.chat_template"]
env = jinja2.Environment(loader=jinja2.BaseLoader())
chats = []
for msgs in MESSAGES:
    text = env.from_string(template).render(messages=msgs, add_generation_prompt=True, bos_token="<|im_start|>", eos_token="<|im_end|>")
    chats.append({"messages": msgs, "text": text, "ids": llm.tokenize(text.encode(), add_bos=False, special=True)})
out = {
    "generator": "llama-cpp-python %s, jinja2 %s" % (llama_cpp.__version__, jinja2.__version__),
    "prompts": [{"text": p, "ids": llm.tokenize(p.encode(), add_bos=False, special=True)} for p in PROMPTS],
    "chats": chats,
}
with open("gpu-engine/tests/fixtures/smollm2_tokens.json", "w") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
print("wrote", len(out["prompts"]), "prompts and", len(chats), "chats")
