"""Drives lockstep with the official `openai` package: chat and completions, streamed and not,
and an over-long prompt. Run by tests/tests/openai_client.rs with LOCKSTEP_URL and LOCKSTEP_MODEL
set; exits non-zero on the first failed check."""

import os
import sys

import openai

BASE = os.environ["LOCKSTEP_URL"] + "/v1"
MODEL = os.environ["LOCKSTEP_MODEL"]
client = openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=10)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


# Chat, non-streamed.
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "alpha bravo"}], max_tokens=5)
check(r.object == "chat.completion", "chat object")
check(r.choices[0].message.role == "assistant", "chat role")
check("alpha" in r.choices[0].message.content, f"chat content echoes the prompt: {r.choices[0].message.content!r}")
check(r.choices[0].finish_reason == "length", "chat finish_reason")
check(r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0, f"chat usage {r.usage}")
check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "chat total tokens")

# Chat, streamed, with usage.
chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "charlie delta"}],
                                             max_tokens=6, stream=True, stream_options={"include_usage": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("charlie" in text, f"chat stream text {text!r}")
check(any(c.choices and c.choices[0].finish_reason == "length" for c in chunks), "chat stream finish")
usage = [c.usage for c in chunks if c.usage]
check(len(usage) == 1 and usage[0].completion_tokens == 6, f"chat stream usage {usage}")

# Completions, non-streamed and streamed.
r = client.completions.create(model=MODEL, prompt="echo foxtrot golf", max_tokens=3)
check(r.choices[0].text.split() == ["echo", "foxtrot", "golf"], f"completion text {r.choices[0].text!r}")
check(r.usage.prompt_tokens == 3, f"completion usage {r.usage}")
chunks = list(client.completions.create(model=MODEL, prompt="hotel india", max_tokens=4, stream=True))
text = "".join(c.choices[0].text for c in chunks if c.choices)
check(text.split() == ["hotel", "india", "hotel", "india"], f"completion stream {text!r}")

# Models.
check(any(m.id == MODEL for m in client.models.list().data), "models list")

# Over-long prompt: a 400 with the stable code, raised as BadRequestError.
try:
    client.completions.create(model=MODEL, prompt="red " * 5000, max_tokens=4)
    check(False, "over-long prompt must fail")
except openai.BadRequestError as e:
    check(e.status_code == 400, "over-long status 400")
    check(e.code == "context_length_exceeded", f"over-long code {e.code}")

# Unknown model: 404.
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    check(False, "unknown model must fail")
except openai.NotFoundError as e:
    check(e.code == "model_not_found", f"unknown model code {e.code}")

# JSON mode reaches SGLang workers, which enforce it (the mock records, does not enforce).
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   response_format={"type": "json_object"})
check(r.choices[0].finish_reason is not None, "json_object passes through to SGLang")

# SGLang's log-probabilities, passed through: one entry per completion token.
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                   logprobs=True, top_logprobs=2)
entries = r.choices[0].logprobs.content
check(len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries),
      f"SGLang's log-probabilities: {entries}")

# What lockstep cannot honour here: a 400 naming the field, never a 200 that ignored it (generic
# tool calls with `tool_choice: auto` need lockstep's own grammar engine).
for kwargs, param in [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
]:
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs)
        check(False, f"{param} must be refused")
    except openai.BadRequestError as e:
        check(e.code == "unsupported" and e.param == param, f"{param} refused: {e.code} {e.param}")

print("all openai client checks passed")
