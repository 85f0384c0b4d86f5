"""Structured outputs on lockstep's own engine, through the official clients: 20 strict JSON
schemas via `response_format`, each streamed and not, with several seeds; every answer must parse
and validate against its schema (the `jsonschema` package judges). Also `json_object`, the
Responses API's `text.format` and Anthropic's `output_config.format`. Run by
tests/tests/embedded.rs with LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero on the first
failed check."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": required if required is not None else list(props),
            "additionalProperties": False}


S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    ("a name", obj({"name": S})),
    ("an age", obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a yes or no", obj({"answer": {"type": "boolean"}})),
    ("a colour", obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a list of fruits", obj({"fruits": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}})),
    ("a point", obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                     "y": {"type": "integer", "minimum": -9, "maximum": 9}})),
    ("a book", obj({"title": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})),
    ("an address", obj({"city": S, "country": S})),
    ("a rating", obj({"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}})),
    ("a nested owner", obj({"pet": obj({"kind": {"enum": ["cat", "dog"]}, "name": S})})),
    ("a code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}})),
    ("flags", obj({"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}})),
    ("an optional note", obj({"title": S, "note": S}, required=["title"])),
    ("a constant", obj({"kind": {"const": "greeting"}, "text": S})),
    ("either a number or a word", obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, S]}})),
    ("a date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("scores", obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                               "minItems": 2, "maxItems": 2}})),
    ("a user with tags", obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 2}})})),
]
check(len(SCHEMAS) == 20, "20 schemas")


def ask(i, what, schema, stream, seed):
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": f"Give me {what} as JSON."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=120, temperature=0.8, seed=seed, response_format=rf)
    if stream:
        chunks = list(oa.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish[-1] if finish else None
    r = oa.chat.completions.create(**kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


jobs = [(i, what, schema, stream, seed) for i, (what, schema) in enumerate(SCHEMAS)
        for stream, seed in [(False, 11 + i), (True, 101 + i), (False, 1001 + i)]]
with ThreadPoolExecutor(max_workers=8) as pool:
    results = list(pool.map(lambda j: (j, ask(*j)), jobs))
for (i, what, schema, stream, seed), (text, finish) in results:
    where = f"schema {i} ({what}), stream={stream}, seed={seed}: {text!r}"
    check(finish == "stop", f"finished by the grammar, {where}")
    try:
        value = json.loads(text)
    except ValueError as e:
        check(False, f"parses ({e}), {where}")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        check(False, f"validates ({e.message}), {where}")
    check(True, f"valid, {where}")

# JSON mode: any object.
r = oa.chat.completions.create(model=MODEL, max_tokens=60, temperature=0,
                               messages=[{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}],
                               response_format={"type": "json_object"})
check(isinstance(json.loads(r.choices[0].message.content), dict), f"json_object: {r.choices[0].message.content!r}")

# The Responses API's text.format and Anthropic's output_config.format.
schema = SCHEMAS[5][1]
r = oa.responses.create(model=MODEL, input="Give me a person as JSON.", max_output_tokens=120, temperature=0.7,
                        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
jsonschema.validate(json.loads(r.output_text), schema)
check(r.status == "completed", f"responses text.format: {r.output_text!r}")
m = an.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Give me a person as JSON."}],
                       output_config={"format": {"type": "json_schema", "schema": schema}})
jsonschema.validate(json.loads(m.content[0].text), schema)
check(m.stop_reason == "end_turn", f"messages output_config.format: {m.content[0].text!r}")

# A malformed schema is refused before any worker sees it.
try:
    oa.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    check(False, "a schema with a dangling $ref must be refused")
except openai.BadRequestError as e:
    check(e.code == "invalid_request" and e.param == "response_format", f"bad schema: {e.code} {e.param}")

print("all structured output checks passed")
