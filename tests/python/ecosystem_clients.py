"""The clients people already use, against `lockstep serve`'s default configuration (SmolLM2 on
the embedded engine, no tool parser configured: generic tool calls): langchain-openai 1.8
(`bind_tools`, `with_structured_output` by function calling and by JSON schema, a tool round
trip, streamed and not), litellm 1.110 (tools, streamed tool calls, log-probabilities) and openai
3.57 (log-probabilities, parallel tool calls off), and several choices (`n`) through all three.
Each case was a 400 before generic tool calls, log-probabilities and `n`. Run by tests/tests/embedded.rs in the clients' own virtual environment
(tests/python/requirements-clients.txt) with LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero
on the first failed check."""

import json
import math
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from GitHub at import

import jsonschema
import litellm
import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"]}


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 degrees and sunny in {city}"


class Person(BaseModel):
    """A person mentioned in the text."""
    name: str = Field(max_length=24, description="The person's name")
    age: int = Field(ge=0, le=150, description="The person's age in years")


llm = ChatOpenAI(base_url=URL + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60,
                 max_retries=0, timeout=120)
question = [HumanMessage("What is the weather in Paris?")]

# LangChain: bind_tools with a forced call, whole and streamed.
forced = llm.bind_tools([get_weather], tool_choice="get_weather")
ai = forced.invoke(question)
check(len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather", f"bind_tools call {ai.tool_calls}")
jsonschema.validate(ai.tool_calls[0]["args"], WEATHER)
check(bool(ai.tool_calls[0]["id"]), "the call has an id")
merged = None
for chunk in forced.stream(question):
    merged = chunk if merged is None else merged + chunk
check(merged is not None and [c["name"] for c in merged.tool_calls] == ["get_weather"],
      f"streamed bind_tools call {merged.tool_calls if merged else None}")
check(merged.tool_calls[0]["args"] == ai.tool_calls[0]["args"], "streamed and whole calls agree (greedy)")

# LangChain: bind_tools with tool_choice auto (the default): text or a valid call, never a 400.
auto = llm.bind_tools([get_weather])
for prompt in ["What is the weather in Paris?", "Say hello."]:
    ai = auto.invoke([HumanMessage(prompt)])
    if ai.tool_calls:
        check(all(c["name"] == "get_weather" for c in ai.tool_calls), f"auto: declared calls only {ai.tool_calls}")
        for c in ai.tool_calls:
            jsonschema.validate(c["args"], WEATHER)
        check(ai.content == "", "auto: a call comes without content")
    else:
        check(isinstance(ai.content, str) and ai.content and not ai.content.lstrip().startswith("{"),
              f"auto: text {ai.content!r}")

# LangChain: the tool's result back as a ToolMessage; the answer is text.
ai = forced.invoke(question)
result = get_weather.invoke(ai.tool_calls[0]["args"])
answer = auto.invoke(question + [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])])
check(isinstance(answer.content, str), f"after the tool result: {answer.content!r} {answer.tool_calls}")
plain = llm.bind_tools([get_weather], tool_choice="none").invoke(
    question + [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])])
check(plain.content and not plain.tool_calls, f"tool_choice none answers in text: {plain.content!r}")

# LangChain: with_structured_output by function calling (a forced call, parallel_tool_calls off)
# and by JSON schema.
text = [HumanMessage("Alice is 30 years old. Extract the person.")]
for method in ["function_calling", "json_schema"]:
    p = llm.with_structured_output(Person, method=method).invoke(text)
    check(isinstance(p, Person), f"with_structured_output({method}): {p!r}")
    raw = llm.with_structured_output(Person, method=method, include_raw=True).invoke(text)
    check(raw["parsing_error"] is None and isinstance(raw["parsed"], Person), f"{method} parses: {raw}")

# The official openai package: chat log-probabilities; parallel_tool_calls off holds one call.
oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)
r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: one, two,"}],
                               logprobs=True, top_logprobs=2, max_tokens=5, temperature=0)
lp = r.choices[0].logprobs.content
check(lp and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lp), f"chat logprobs {lp}")
check("".join(e.token for e in lp) == r.choices[0].message.content, "the tokens spell the answer")
tools = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}}]
r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
                               tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                               temperature=0)
check(r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1,
      f"one call with parallel_tool_calls off: {r.choices[0].message.tool_calls}")

# Several choices: seeded, each choice equals a one-choice request with the seed moved on by its index;
# streamed, the openai package's chunks name their choice and rebuild the same texts.
ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=1.0,
           seed=5)
r = oa.chat.completions.create(n=3, **ask)
texts = [c.message.content for c in r.choices]
check([c.index for c in r.choices] == [0, 1, 2], f"openai n=3 {texts}")
ones = [oa.chat.completions.create(**{**ask, "seed": 5 + i}) for i in range(3)]
for i, one in enumerate(ones):
    check(one.choices[0].message.content == texts[i], f"choice {i} is seed {5 + i}'s answer: {one.choices[0]}")
check(r.usage.prompt_tokens == ones[0].usage.prompt_tokens
      and r.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones),
      f"usage: the prompt once, every choice's tokens: {r.usage}")
streamed = {}
for chunk in oa.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask):
    for c in chunk.choices:
        streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    if chunk.usage is not None:
        check(chunk.usage.completion_tokens == r.usage.completion_tokens, f"streamed usage {chunk.usage}")
check([streamed.get(i) for i in range(3)] == texts, f"openai streamed n=3 {streamed}")
c = oa.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0, seed=9)
check(sorted(x.index for x in c.choices) == [0, 1], f"completions n=2 {c}")
# LangChain: `n` generations of one prompt.
gens = ChatOpenAI(base_url=URL + "/v1", api_key="unused", model=MODEL, temperature=1.0, max_tokens=8, n=2,
                  seed=5, max_retries=0, timeout=120).generate([[HumanMessage("Name a fruit.")]]).generations[0]
check([g.text for g in gens] == texts[:2], f"langchain n=2 {[g.text for g in gens]} vs {texts[:2]}")

# litellm: a forced call (required, then named), whole and streamed; log-probabilities.
named = {"type": "function", "function": {"name": "get_weather"}}
common = dict(model="openai/" + MODEL, api_base=URL + "/v1", api_key="unused", temperature=0, max_tokens=60,
              num_retries=0, timeout=120)
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
r = litellm.completion(messages=msgs, tools=tools, tool_choice="required", **common)
calls = r.choices[0].message.tool_calls
check(calls and calls[0].function.name == "get_weather", f"litellm call {calls}")
jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
chunks = list(litellm.completion(messages=msgs, tools=tools, tool_choice=named, stream=True, **common))
rebuilt = litellm.stream_chunk_builder(chunks, messages=msgs)
check(rebuilt.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments,
      f"litellm streamed call {rebuilt.choices[0].message.tool_calls}")
r = litellm.completion(messages=[{"role": "user", "content": "Count: one, two,"}], logprobs=True, top_logprobs=2,
                       **{**common, "max_tokens": 5})
lp = r.choices[0].logprobs["content"] if isinstance(r.choices[0].logprobs, dict) else r.choices[0].logprobs.content
first = lp[0] if isinstance(lp[0], dict) else lp[0].model_dump()
check(math.isfinite(first["logprob"]) and len(first["top_logprobs"]) == 2, f"litellm logprobs {first}")
# litellm: several choices, as the openai package sees them.
r = litellm.completion(messages=ask["messages"], n=3, seed=5, **{**common, "temperature": 1.0, "max_tokens": 8})
check([c.message.content for c in r.choices] == texts, f"litellm n=3 {[c.message.content for c in r.choices]}")
# A plain litellm chat, for the default config.
r = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **common)
check(bool(r.choices[0].message.content), f"litellm chat {r.choices[0].message.content!r}")

print("all ecosystem client checks passed")
