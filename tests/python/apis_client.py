"""Drives lockstep's Responses API with the official `openai` package and its Messages API with the
official `anthropic` package: streamed and not, the event types each package reads, usage,
fields lockstep refuses, and an over-long prompt refused in each API's own error shape. Run by
tests/tests/apis.rs (against the PD mock, whose decode echoes the prompt) and tests/tests/embedded.rs
(against the real model) with LOCKSTEP_URL and LOCKSTEP_MODEL set; LOCKSTEP_ECHO=1 says the
answer echoes the prompt. Exits non-zero on the first failed check."""

import json
import os
import sys

import anthropic
import openai

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
ECHO = os.environ.get("LOCKSTEP_ECHO") == "1"
oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=60)
an = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0, timeout=60)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def refused(call, exc, what, status=400):
    try:
        call()
    except exc as e:
        check(e.status_code == status, f"{what}: status {e.status_code}")
        return e
    check(False, f"{what} must be refused")


# --- Responses API (openai) ---------------------------------------------------------------
r = oa.responses.create(model=MODEL, input="alpha bravo charlie", max_output_tokens=6, temperature=0)
check(r.object == "response" and r.id.startswith("resp_"), f"response object {r.id}")
check(r.status in ("completed", "incomplete"), f"response status {r.status}")
check(len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant", "one message")
text = r.output_text
check(len(text) > 0, f"output_text {text!r}")
if ECHO:
    check("alpha" in text, f"the mock's answer echoes the prompt: {text!r}")
check(r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 6, f"usage {r.usage}")
check(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, "total tokens")
if r.status == "incomplete":
    check(r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6, "incomplete at the cap")

events = list(oa.responses.create(model=MODEL, input="alpha bravo charlie", max_output_tokens=6, temperature=0,
                                  stream=True))
types = [e.type for e in events]
check(types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"], f"stream opening {types[:4]}")
check(types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"],
      f"stream closing {types[-4:]}")
check(types[-1] in ("response.completed", "response.incomplete"), f"terminal event {types[-1]}")
check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check(streamed == text, f"streamed text equals the non-streamed: {streamed!r}")
final = events[-1].response
check(final.output_text == text and final.usage.output_tokens == r.usage.output_tokens, "final response")

# Messages as input, with instructions: the system prompt counts in the input.
# (A template may add a default system prompt of its own, so two instructions are compared.)
def with_instructions(instructions):
    return oa.responses.create(model=MODEL, instructions=instructions, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "alpha bravo charlie"}]}])


r2 = with_instructions("Answer briefly.")
r3 = with_instructions("Answer briefly, kindly and in plain English.")
check(r3.usage.input_tokens == r2.usage.input_tokens + 6, f"instructions are part of the prompt {r2.usage} {r3.usage}")
check(r2.instructions == "Answer briefly.", "instructions echoed")

# Stored by default (tests/python/responses_state_client.py covers the state); an unknown
# previous response is a 404.
check(oa.responses.retrieve(r.id).id == r.id, "stored by default, retrieved")
e = refused(lambda: oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id="resp_1"),
            openai.NotFoundError, "an unknown previous response", status=404)
check(e.code == "not_found", f"previous_response_id: {e.code}")
# Function tools on a model without a tool parser (generic tool calls): a forced call comes back as
# a `function_call` item with arguments valid for its schema on lockstep's engine; on the SGLang
# mock (which records constraints, not enforces them) `auto` is refused by name, since only
# lockstep's engine takes the text-or-calls grammar.
F = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                      "required": ["x"]}}]
if ECHO:
    e = refused(lambda: oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, tools=F),
                openai.BadRequestError, "responses generic tools with auto on SGLang")
    check(e.code == "unsupported" and e.param == "tools", f"tools: {e.code} {e.param}")
else:
    r = oa.responses.create(model=MODEL, input="Call f with x = 3.", max_output_tokens=40, tools=F,
                            tool_choice="required", temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "f" and isinstance(json.loads(calls[0].arguments)["x"], int),
          f"a forced call as a function_call item: {r.output}")
e = refused(lambda: oa.responses.create(model=MODEL, input="red " * 5000, max_output_tokens=4),
            openai.BadRequestError, "responses over-long prompt")
check(e.code == "context_length_exceeded", f"over-long code {e.code}")
e = refused(lambda: oa.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_1"}]),
            openai.BadRequestError, "a non-message input item")
check(e.code == "unsupported", f"item type refused: {e.code}")

# --- Messages API (anthropic) -------------------------------------------------------------
# Recent `anthropic` releases no longer take sampling arguments; older clients and raw HTTP send
# `temperature`, which lockstep honours (here through `extra_body`).
m = an.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0},
                       messages=[{"role": "user", "content": "alpha bravo charlie"}])
check(m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), f"message {m.id}")
check(len(m.content) == 1 and m.content[0].type == "text", "one text block")
mtext = m.content[0].text
check(len(mtext) > 0, f"message text {mtext!r}")
check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
if m.stop_reason == "max_tokens":
    check(m.usage.output_tokens == 6, f"output tokens at the cap {m.usage}")
check(m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0, f"usage {m.usage}")
if ECHO:
    check("alpha" in mtext, f"the mock's answer echoes the prompt: {mtext!r}")

with an.messages.stream(model=MODEL, max_tokens=6, extra_body={"temperature": 0},
                        messages=[{"role": "user", "content": "alpha bravo charlie"}]) as s:
    streamed = "".join(s.text_stream)
    fm = s.get_final_message()
check(streamed == mtext, f"streamed message equals the non-streamed: {streamed!r}")
check(fm.stop_reason == m.stop_reason and fm.usage.output_tokens == m.usage.output_tokens, f"final message {fm}")

raw = [e.type for e in an.messages.create(model=MODEL, max_tokens=3, stream=True,
                                          messages=[{"role": "user", "content": "hi there"}])]
check(raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop", "message_delta",
                                                                         "message_stop"], f"event order {raw}")

def with_system(system):
    return an.messages.create(model=MODEL, max_tokens=4, system=system, messages=[
        {"role": "user", "content": [{"type": "text", "text": "alpha bravo charlie"}]}]).usage.input_tokens


check(with_system("Answer briefly, kindly and in plain English.") == with_system("Answer briefly.") + 6,
      "the system prompt is part of the prompt")

if not ECHO:
    # A stop sequence ends the answer before it, and the answer says which one (the engine
    # reports the string it matched).
    ask = [{"role": "user", "content": "Write one sentence about the sea."}]
    full = an.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=ask).content[0].text
    word = full.split()[2]
    cut = an.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=ask,
                             stop_sequences=["zzzz", word])
    check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == word,
          f"stop_sequence reported: {cut.stop_reason} {cut.stop_sequence!r}")
    check(cut.content[0].text == full[:full.index(word)], f"text before the stop: {cut.content[0].text!r}")
    with an.messages.stream(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=ask,
                            stop_sequences=[word]) as s:
        fm = s.get_final_message()
    check(fm.stop_reason == "stop_sequence" and fm.stop_sequence == word, "streamed stop_sequence")

e = refused(lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "red " * 5000}]),
            anthropic.BadRequestError, "messages over-long prompt")
check(e.body["error"]["type"] == "invalid_request_error" and e.body["error"]["code"] == "context_length_exceeded",
      f"anthropic error shape {e.body}")
for kwargs, what in [
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "effort"),
    ({"speed": "fast"}, "speed"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
]:
    e = refused(lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                           **kwargs), anthropic.BadRequestError, f"messages {what}")
    check(e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", f"{what}: {e.body}")
e = refused(lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[
    {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]),
    anthropic.BadRequestError, "a final assistant turn (prefill)")
check(e.body["error"]["code"] == "unsupported", f"prefill refused {e.body}")
e = refused(lambda: an.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]),
            anthropic.NotFoundError, "an unknown model", 404)
check(e.body["error"]["type"] == "not_found_error", f"404 shape {e.body}")

print("all api client checks passed")
