"""lm-evaluation-harness 0.4.13's `RemoteTokenizer` (`lm_eval/utils.py`, what `local-completions`
uses with `tokenizer_backend=remote`) against lockstep's /tokenizer_info, /tokenize and
/detokenize, on the real SmolLM2 model: every id and text must be llama.cpp's
(`gpu-engine/tests/fixtures/smollm2_tokens.json`, made by llama-cpp-python), and the chat
template it reads back must render each chat as llama.cpp's Jinja did.
"""

import json
import os

from lm_eval.utils import RemoteTokenizer

URL = os.environ["LOCKSTEP_URL"]
FIXTURE = json.load(open(os.environ["LOCKSTEP_TOKEN_FIXTURE"], encoding="utf-8"))

# lm-eval hands it the completions URL; it strips the path itself.
tok = RemoteTokenizer(f"{URL}/v1/completions", timeout=60)

for p in FIXTURE["prompts"]:
    ids = tok.encode(p["text"])
    assert ids == p["ids"], (p["text"], ids, p["ids"])
    assert tok(p["text"])["input_ids"] == p["ids"]
    assert tok.decode(ids) == p["text"], (tok.decode(ids), p["text"])
texts = tok.batch_decode([p["ids"] for p in FIXTURE["prompts"]])
assert texts == [p["text"] for p in FIXTURE["prompts"]]

for c in FIXTURE["chats"]:
    text = tok.apply_chat_template(c["messages"], add_generation_prompt=True)
    assert text == c["text"], (text, c["text"])
    # The rendered chat's special tokens are parsed as special tokens, as generation parses
    # the template's own text.
    assert tok.encode(text) == c["ids"], (tok.encode(text), c["ids"])

assert tok.eos_token == "<|im_end|>", tok.eos_token
assert tok.eos_token_id == 2, tok.eos_token_id
assert tok.bos_token == "<|im_start|>", tok.bos_token
print("lm-eval remote tokenizer checks passed")
