"""Drives lockstep's stored responses and conversations with the official `openai` package (3.57,
in the clients' own virtual environment) and LangChain's `ChatOpenAI(use_responses_api=True)`:
`responses.create(store=True)`, `previous_response_id`, `responses.retrieve`, `input_items`,
`background=True` with `responses.cancel`, a background stream resumed with `starting_after`,
`conversations.create` and its items, a response in a conversation, deletion, and LangChain
chaining turns with `use_previous_response_id`. Run by tests/tests/responses_state.rs (the SGLang
and vLLM mocks) and tests/tests/embedded.rs (the real model) with LOCKSTEP_URL and LOCKSTEP_MODEL
set (LOCKSTEP_KEY: the API key, if the stack has tenants); LOCKSTEP_SLOW=1 says the backend decodes slowly enough for a background response to be
cancelled while it runs. Exits non-zero on the first failed check."""

import os
import sys
import time

import openai
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
SLOW = os.environ.get("LOCKSTEP_SLOW") == "1"
KEY = os.environ.get("LOCKSTEP_KEY", "unused")
oa = openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def settled(rid, bound=60.0):
    start = time.monotonic()
    while time.monotonic() - start < bound:
        r = oa.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.1)
    check(False, f"{rid} settles within {bound} s")


# --- store, retrieve, input items, chaining -------------------------------------------------
first = oa.responses.create(model=MODEL, input="My name is Ada. Say hello.", max_output_tokens=8,
                            temperature=0, store=True)
check(first.store is True and first.id.startswith("resp_"), f"stored: {first.id}")
got = oa.responses.retrieve(first.id)
check(got.id == first.id and got.output_text == first.output_text, "retrieved as answered")
items = oa.responses.input_items.list(first.id)
check(len(items.data) == 1 and items.data[0].type == "message" and items.data[0].role == "user",
      f"input items {items.data}")
second = oa.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0,
                             previous_response_id=first.id)
check(second.previous_response_id == first.id, "chained")
check(second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens,
      f"the chained prompt holds the first turn: {second.usage.input_tokens} vs {first.usage}")
deleted = oa.responses.delete(first.id)
try:
    oa.responses.retrieve(first.id)
    check(False, "a deleted response is gone")
except openai.NotFoundError as e:
    check(e.status_code == 404, "a deleted response is gone")

# --- background: polled, streamed and resumed, cancelled --------------------------------------
bg = oa.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=8, temperature=0,
                         background=True)
check(bg.status == "queued" and bg.background is True, f"queued: {bg.status}")
done = settled(bg.id)
check(done.status in ("completed", "incomplete") and done.usage.output_tokens > 0, f"settled: {done.status}")
events = list(oa.responses.retrieve(bg.id, stream=True))
check([e.sequence_number for e in events] == list(range(len(events))), "the whole stream, in order")
check(events[-1].type in ("response.completed", "response.incomplete"), f"ends {events[-1].type}")
tail = list(oa.responses.retrieve(bg.id, stream=True, starting_after=2))
check([e.sequence_number for e in tail] == [e.sequence_number for e in events[3:]], "resumed after 2")
text = "".join(e.delta for e in tail if e.type == "response.output_text.delta")
check(text.endswith("".join(e.delta for e in events[-6:] if e.type == "response.output_text.delta")),
      "the resumed text")

live = oa.responses.create(model=MODEL, input="Tell a story.", max_output_tokens=12, temperature=0,
                           background=True, stream=True)
seen = []
for e in live:
    seen.append(e)
    if e.sequence_number >= 3:
        break  # the client goes away; the response runs on
live.close()
resumed = list(oa.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
check(resumed and resumed[0].sequence_number == seen[-1].sequence_number + 1, "a dropped stream is resumed")
check(resumed[-1].type in ("response.completed", "response.incomplete"), "and ends")

if SLOW:
    long = oa.responses.create(model=MODEL, input="Write a long essay.", max_output_tokens=400,
                               background=True)
    time.sleep(0.5)
    cancelled = oa.responses.cancel(long.id)
    check(cancelled.status == "cancelled", f"cancelled: {cancelled.status}")
    time.sleep(0.5)
    check(oa.responses.retrieve(long.id).status == "cancelled", "stays cancelled")

# --- conversations -------------------------------------------------------------------------
conv = oa.conversations.create(metadata={"topic": "names"},
                               items=[{"type": "message", "role": "user", "content": "My name is Grace."}])
check(conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}, f"conversation {conv.id}")
r = oa.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0,
                        conversation=conv.id)
listed = oa.conversations.items.list(conv.id, order="asc")
check(len(listed.data) == 3, f"the conversation holds its item, the input and the output: {len(listed.data)}")
check(listed.data[2].role == "assistant" and listed.data[2].content[0].text == r.output_text, "the output")
added = oa.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Thanks."}])
one = oa.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
check(one.id == added.data[0].id, "an item retrieved")
updated = oa.conversations.update(conv.id, metadata={"topic": "done"})
check(updated.metadata == {"topic": "done"}, "metadata updated")
gone = oa.conversations.delete(conv.id)
check(gone.deleted is True, "conversation deleted")

# --- LangChain: turns chained by previous_response_id ---------------------------------------
llm = ChatOpenAI(model=MODEL, base_url=URL + "/v1", api_key=KEY, max_retries=0, temperature=0,
                 max_tokens=8, use_responses_api=True, use_previous_response_id=True)
history = [HumanMessage("My favourite colour is teal.")]
a1 = llm.invoke(history)
rid = a1.response_metadata.get("id")
check(isinstance(rid, str) and rid.startswith("resp_"), f"langchain turn 1: {rid}")
history += [a1, HumanMessage("What is my favourite colour?")]
a2 = llm.invoke(history)
prev = oa.responses.retrieve(a2.response_metadata["id"]).previous_response_id
check(prev == rid, f"langchain chained turn 2 on turn 1: {prev}")
check(a2.usage_metadata["input_tokens"] > a1.usage_metadata["input_tokens"], "turn 2 read turn 1")

print("all responses state checks passed")
