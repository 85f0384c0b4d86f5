"""Log-probabilities through lockstep in front of the SGLang or vLLM mock, read by the clients
people use: openai 3.57 (chat and completions, streamed and not), litellm 1.110 and
langchain-openai 1.8. Every answer carries one entry per completion token with the alternatives
asked for, and a stream's entries are the whole answer's; several choices (`n`) each carry their
own, whole and streamed. Run by tests/tests/logprobs_sglang.rs
and tests/tests/vllm_pd.rs in the clients' own virtual environment with LOCKSTEP_URL,
LOCKSTEP_MODEL and LOCKSTEP_KEY set; exits non-zero on the first failed check."""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from GitHub at import

import litellm
import openai
from langchain_openai import ChatOpenAI

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
KEY = os.environ.get("LOCKSTEP_KEY") or "unused"


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


oa = openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=30)
msgs = [{"role": "user", "content": "red green blue yellow"}]

# Chat, whole and streamed.
r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2)
whole = r.choices[0].logprobs.content
check(len(whole) == r.usage.completion_tokens, f"one entry per token: {len(whole)} {r.usage}")
check(all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in whole), "two alternatives each")
streamed = []
for chunk in oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2,
                                        stream=True):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed.extend(chunk.choices[0].logprobs.content)
check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole],
      "the stream's entries are the whole answer's")

# Completions: tokens, values and the sampled token with its alternatives.
c = oa.completions.create(model=MODEL, prompt="red green blue yellow", max_tokens=4, logprobs=2)
lp = c.choices[0].logprobs
check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens,
      f"completion entries {lp}")
check(all(1 <= len(t) <= 3 for t in lp.top_logprobs), "the sampled token and two alternatives")

# litellm.
r = litellm.completion(model="openai/" + MODEL, api_base=URL + "/v1", api_key=KEY, messages=msgs, max_tokens=4,
                       logprobs=True, top_logprobs=2, num_retries=0, timeout=30)
content = r.choices[0].logprobs["content"] if isinstance(r.choices[0].logprobs, dict) \
    else r.choices[0].logprobs.content
check(len(content) == r.usage.completion_tokens, f"litellm entries {content}")

# LangChain.
llm = ChatOpenAI(base_url=URL + "/v1", api_key=KEY, model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2,
                 max_retries=0, timeout=30)
ai = llm.invoke("red green blue yellow")
entries = ai.response_metadata["logprobs"]["content"]
check(len(entries) == ai.usage_metadata["output_tokens"] and all(len(e["top_logprobs"]) == 2 for e in entries),
      f"langchain entries {entries}")

# Several choices, each its own pair with its own entries, whole and streamed.
r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=2, logprobs=True, top_logprobs=1)
check([c.index for c in r.choices] == [0, 1], f"two choices {r.choices}")
check(sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens,
      f"every choice's tokens have their entries: {r.usage}")
seen = {}
for chunk in oa.completions.create(model=MODEL, prompt="red green blue", max_tokens=3, n=2, logprobs=1, stream=True):
    for c in chunk.choices:
        seen.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else [])
check(sorted(seen) == [0, 1] and all(len(v) == 3 for v in seen.values()), f"streamed choices' entries {seen}")
r = litellm.completion(model="openai/" + MODEL, api_base=URL + "/v1", api_key=KEY, messages=msgs, max_tokens=4, n=2,
                       num_retries=0)
check(len(r.choices) == 2, f"litellm n=2 {r.choices}")

print("all mock log-probability client checks passed")
