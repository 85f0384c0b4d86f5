"""Log-probabilities on lockstep's embedded engine (the real SmolLM2 model) through the official
`openai` package: chat `logprobs` / `top_logprobs`, completions `logprobs` and the Responses API's
`include` + `top_logprobs`, streamed and not.
Checks what a client relies on: one entry per generated token, the sampled token first among
the alternatives under greedy decoding, alternatives most likely first and at most a total
probability of 1, each token's bytes exact (their concatenation is the answer's UTF-8, byte-level
tokens that split a character included), text offsets that index the text, a stream that
carries the same entries as the whole answer, and clear 400s for what is out of range. Run by
tests/tests/embedded.rs with LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero on the first
failed check."""

import math
import os
import sys

import openai

BASE = os.environ["LOCKSTEP_URL"] + "/v1"
MODEL = os.environ["LOCKSTEP_MODEL"]
client = openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def token_bytes_ok(entry):
    """`token` is the text of `bytes`, or OpenAI's `bytes:\\xNN` form where they are not UTF-8."""
    raw = bytes(entry.bytes)
    try:
        return entry.token == raw.decode("utf-8")
    except UnicodeDecodeError:
        return entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_chat_entries(entries, content, usage, top, what):
    check(len(entries) == usage.completion_tokens, f"{what}: one entry per token ({len(entries)})")
    for e in entries:
        check(token_bytes_ok(e), f"{what}: token {e.token!r} and bytes {e.bytes} agree")
        check(e.logprob <= 0, f"{what}: a log-probability is at most 0 ({e.logprob})")
        check(len(e.top_logprobs) == top, f"{what}: {top} alternatives")
        lps = [t.logprob for t in e.top_logprobs]
        check(lps == sorted(lps, reverse=True), f"{what}: alternatives most likely first")
        check(sum(math.exp(x) for x in lps) <= 1.0 + 1e-4, f"{what}: alternatives' probabilities sum to at most 1")
        if top:
            # Greedy, no penalties: the sampled token is the most likely one.
            check(e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6,
                  f"{what}: greedy picks the most likely ({e.token!r})")
    joined = b"".join(bytes(e.bytes) for e in entries)
    check(joined == content.encode("utf-8"), f"{what}: the tokens' bytes make the answer {content!r}")


# Chat, greedy, three alternatives.
msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                   logprobs=True, top_logprobs=3)
content = r.choices[0].message.content
entries = r.choices[0].logprobs.content
check_chat_entries(entries, content, r.usage, 3, "chat")

# The same request streamed: the same entries, spread over the chunks.
chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True,
                                             stream_options={"include_usage": True}))
streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
check([(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries],
      "streamed chat carries the same tokens")
check(all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, entries)),
      "streamed chat carries the same log-probabilities")

# logprobs without alternatives.
r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)
check_chat_entries(r.choices[0].logprobs.content, r.choices[0].message.content, r.usage, 0, "chat, no top")

# Not asked: no logprobs object.
r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
check(r.choices[0].logprobs is None, "chat without logprobs has none")

# Text outside ASCII: tokens that are part of a character keep their exact bytes.
r = client.chat.completions.create(
    model=MODEL, max_tokens=24, temperature=0, logprobs=True, top_logprobs=1,
    messages=[{"role": "user", "content": "Write the word 'coffee' in Japanese, Chinese and Russian."}])
check_chat_entries(r.choices[0].logprobs.content, r.choices[0].message.content, r.usage, 1, "non-ASCII chat")

# Completions, two alternatives besides the sampled token.
prompt = "The capital of France is"
r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
text, lp = r.choices[0].text, r.choices[0].logprobs
check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
      == r.usage.completion_tokens, f"completion: one entry per token ({len(lp.tokens)})")
check("".join(lp.tokens) == text, f"completion: the tokens make the text {text!r}")
check(lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))],
      f"completion: text offsets index the text {lp.text_offset}")
for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    check(tok in top and abs(top[tok] - tlp) < 1e-6 and 1 <= len(top) <= 3,
          f"completion: the sampled token and its alternatives {top}")
    check(max(top.values()) == tlp, "completion: greedy picks the most likely")

r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=True)
toks, offs, lps = [], [], []
for c in r2:
    if c.choices and c.choices[0].logprobs:
        toks += c.choices[0].logprobs.tokens
        offs += c.choices[0].logprobs.text_offset
        lps += c.choices[0].logprobs.token_logprobs
check(toks == lp.tokens and offs == lp.text_offset, "streamed completion carries the same tokens and offsets")
check(all(abs(a - b) < 1e-5 for a, b in zip(lps, lp.token_logprobs)), "streamed completion: same log-probabilities")

# A stop string: its tokens were generated (and counted) though their text is cut; each has its
# entry, streamed or not, and the stream's held-back text does not lose them.
body = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, stop=["."])
r = client.completions.create(**body)
check(r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text, f"stopped: {r.choices[0].text!r}")
check(len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens,
      f"stopped completion: one entry per generated token ({r.choices[0].logprobs.tokens})")
streamed = [t for c in client.completions.create(stream=True, **body)
            if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
check(streamed == r.choices[0].logprobs.tokens, f"stopped stream: the same entries {streamed}")

# logprobs=0: the sampled token's alone.
r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
check(all(len(t) == 1 for t in r.choices[0].logprobs.top_logprobs), "completion logprobs=0: the sampled token only")

# Scoring a text as lm-evaluation-harness's `local-completions` does: `echo` with `logprobs` and
# one token. Every prompt token comes back, the first with None, the rest scored; the
# continuation's log-likelihood is the sum over its tokens, and "is greedy" compares each token
# with its top alternative.
context, continuation = "The capital of France is", " Paris"
r = client.completions.create(model=MODEL, prompt=context + continuation, max_tokens=1, temperature=0, echo=True,
                              logprobs=1)
lp = r.choices[0].logprobs
n_prompt = r.usage.prompt_tokens
check(len(lp.tokens) == n_prompt + r.usage.completion_tokens, f"echo: every prompt token and the answer's {lp.tokens}")
check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "echo: the first prompt token has no value")
check("".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(context + continuation),
      "echo: the tokens spell the prompt and the answer")
cont_tokens = len(client.completions.create(model=MODEL, prompt=continuation, max_tokens=1, echo=True,
                                            logprobs=0).choices[0].logprobs.tokens) - 1
ll = sum(lp.token_logprobs[n_prompt - cont_tokens:n_prompt])
greedy = all(max(top, key=top.get) == tok for tok, top in zip(lp.tokens[n_prompt - cont_tokens:n_prompt],
                                                               lp.top_logprobs[n_prompt - cont_tokens:n_prompt]))
check(-20 < ll < 0, f"the continuation's log-likelihood {ll} (greedy: {greedy})")

# The Responses API: `include` with `top_logprobs`, whole and streamed.
INCLUDE = ["message.output_text.logprobs"]
r = client.responses.create(model=MODEL, input="Write one sentence about the sea.", max_output_tokens=16,
                            temperature=0, include=INCLUDE, top_logprobs=2)
part = r.output[0].content[0]
check_chat_entries(part.logprobs, part.text, type("U", (), {"completion_tokens": r.usage.output_tokens}), 2,
                   "responses")
check(r.top_logprobs == 2, f"the response repeats top_logprobs ({r.top_logprobs})")
deltas, done = [], None
for ev in client.responses.create(model=MODEL, input="Write one sentence about the sea.", max_output_tokens=16,
                                  temperature=0, include=INCLUDE, top_logprobs=2, stream=True):
    if ev.type == "response.output_text.delta":
        deltas += ev.logprobs
    elif ev.type == "response.output_text.done":
        done = ev.logprobs
check([e.token for e in done] == [e.token for e in part.logprobs], "streamed response: the done event lists every token")
check([e.token for e in deltas] == [e.token for e in part.logprobs][:len(deltas)] and len(deltas) >= len(done) - 2,
      "streamed response: the deltas carry the tokens in order")
r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
check(r.output[0].content[0].logprobs == [], "a response without include has an empty list")
for kwargs, code, what in [
    ({"top_logprobs": 2}, "invalid_request", "top_logprobs without include"),
    ({"include": ["reasoning.encrypted_content"]}, "unsupported", "an include lockstep does not produce"),
]:
    try:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, **kwargs)
        check(False, f"{what} is refused")
    except openai.BadRequestError as e:
        check(e.code == code, f"{what}: {e.code}")

# Out of range, or asked wrongly: a 400 with a stable code, never an answer without them.
for kwargs, what in [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs over 20"),
    ({"top_logprobs": 2}, "top_logprobs without logprobs"),
]:
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kwargs)
        check(False, f"{what} is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.code == "invalid_request", f"{what}: {e.code}")
try:
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=21)
    check(False, "completion logprobs over 20 is refused")
except openai.BadRequestError as e:
    check(e.code == "invalid_request", f"completion logprobs over 20: {e.code}")

print("all logprobs checks passed")
