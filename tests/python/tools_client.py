"""A multi-turn tool conversation with the official `openai` package against lockstep's embedded
engine (SmolLM2 with the bundled ChatML tool template and the Hermes parser): a forced call
(`tool_choice` required, and a named function) comes back as `tool_calls` with arguments valid
for the function's schema, streamed as tool-call deltas too; the tool's result goes back as a
`tool` message and the model answers in text. Run by tests/tests/embedded.rs with LOCKSTEP_URL
and LOCKSTEP_MODEL set; exits non-zero on the first failed check."""

import json
import os
import sys

import jsonschema
import openai

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
        "additionalProperties": False}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                      "parameters": TIME}},
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

# Turn 1: a forced call.
r = oa.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required", max_tokens=80,
                               temperature=0)
choice = r.choices[0]
check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
calls = choice.message.tool_calls
check(calls and len(calls) == 1 and calls[0].type == "function", f"one call {calls}")
call = calls[0]
check(call.function.name in ("get_weather", "get_time"), f"a known function: {call.function.name}")
args = json.loads(call.function.arguments)
jsonschema.validate(args, WEATHER if call.function.name == "get_weather" else TIME)
check(True, f"arguments valid for the schema: {args}")

# The same turn streamed: tool-call deltas that add up to the same call.
chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                         max_tokens=80, temperature=0, stream=True))
deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
check(len(deltas) >= 1 and deltas[0].function.name == call.function.name, f"streamed call {deltas}")
check("".join(d.function.arguments or "" for d in deltas) == call.function.arguments, "streamed arguments")
check([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"],
      "streamed finish_reason")

# A named function is the one called.
r = oa.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=80, temperature=0,
                               tool_choice={"type": "function", "function": {"name": "get_time"}})
named = r.choices[0].message.tool_calls
check(named and named[0].function.name == "get_time", f"named call {named}")
jsonschema.validate(json.loads(named[0].function.arguments), TIME)

# Turn 2: the tool's result goes back; the model answers in text (it may not call again).
messages.append({"role": "assistant", "content": None, "tool_calls": [
    {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})})
r2 = oa.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=40,
                                temperature=0)
check(r2.choices[0].message.tool_calls is None and r2.choices[0].message.content, f"a text answer {r2.choices[0]}")
check(r2.usage.prompt_tokens > r.usage.prompt_tokens, "the history with the call and its result is in the prompt")

# Refusals: a forced call without tools, an unknown named function.
for kwargs, param in [({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")]:
    try:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
        check(False, f"{kwargs} must be refused")
    except openai.BadRequestError as e:
        check(e.param == param, f"refused: {e.code} {e.param}")

# The Responses API: flat function tools, a forced call as a `function_call` output item, its
# result sent back as a `function_call_output` item.
rtools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}]
r = oa.responses.create(model=MODEL, input="What is the weather in Paris?", tools=rtools, tool_choice="required",
                        max_output_tokens=80, temperature=0)
fcalls = [o for o in r.output if o.type == "function_call"]
check(r.status == "completed" and len(fcalls) == 1 and fcalls[0].name == "get_weather", f"responses call {r.output}")
jsonschema.validate(json.loads(fcalls[0].arguments), WEATHER)
events = list(oa.responses.create(model=MODEL, input="What is the weather in Paris?", tools=rtools,
                                  tool_choice="required", max_output_tokens=80, temperature=0, stream=True))
types = [e.type for e in events]
check("response.function_call_arguments.done" in types and types[-1] == "response.completed", f"streamed {types}")
done = [e for e in events if e.type == "response.function_call_arguments.done"]
check(done[0].arguments == fcalls[0].arguments, "streamed arguments equal the non-streamed")
r2 = oa.responses.create(model=MODEL, tools=rtools, tool_choice="none", max_output_tokens=30, temperature=0, input=[
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": fcalls[0].call_id, "name": "get_weather", "arguments": fcalls[0].arguments},
    {"type": "function_call_output", "call_id": fcalls[0].call_id, "output": json.dumps({"temperature": 21})},
])
check(r2.output_text and not [o for o in r2.output if o.type == "function_call"], f"responses text answer {r2.output_text!r}")

print("all tool checks passed")
