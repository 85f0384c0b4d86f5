"""Drives lockstep's embedded engine (the real SmolLM2 model) with the official `openai` package:
coherent answers, streamed and not, seeded sampling, stop strings, and an over-long prompt. Run
by tests/tests/embedded.rs with LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero on the first
failed check."""

import os
import sys

import openai

BASE = os.environ["LOCKSTEP_URL"] + "/v1"
MODEL = os.environ["LOCKSTEP_MODEL"]
client = openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=60)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


models = [m.id for m in client.models.list()]
check(MODEL in models, f"models list {models}")

# Completions: greedy, non-streamed and streamed give the same coherent text.
r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
text = r.choices[0].text
check("Paris" in text, f"completion is coherent: {text!r}")
check(r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8, f"usage {r.usage}")
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
check(streamed == text, f"streamed completion equals non-streamed: {streamed!r}")

# Chat, non-streamed and streamed.
msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
answer = r.choices[0].message.content
check(r.choices[0].message.role == "assistant" and len(answer.split()) >= 3, f"chat answer {answer!r}")
check("<|im_end|>" not in answer and "<|im_start|>" not in answer, "no special tokens in the text")
chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(streamed == answer, f"streamed chat equals non-streamed: {streamed!r}")
check([c.usage.completion_tokens for c in chunks if c.usage] == [r.usage.completion_tokens], "stream usage")

# Seeded sampling: same seed, same text.
a = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7)
b = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7)
check(a.choices[0].text == b.choices[0].text, f"seeded sampling repeats: {a.choices[0].text!r}")

# A stop string ends the text before it.
r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["."])
check(r.choices[0].text == text.split(".")[0] and r.choices[0].finish_reason == "stop",
      f"stop string: {r.choices[0].text!r} {r.choices[0].finish_reason}")

# Over the context window: a clear 400 with the stable code.
try:
    client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=8)
    check(False, "an over-long prompt is refused")
except openai.BadRequestError as e:
    check(e.code == "context_length_exceeded", f"over-long prompt code {e.code}")

print("all embedded openai checks passed")
