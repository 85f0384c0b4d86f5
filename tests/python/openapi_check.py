"""Checks lockstep's OpenAPI document (`GET /openapi.json`) against the server that serves it:
the document is a valid OpenAPI 3.1 document (openapi-spec-validator); every operation in it has
a sample call here and every sample names an operation in it (so a route added to either side
fails); each sample is answered (never 404 `route_not_found` or 405) and its answer validates
against the documented schema for its status: whole JSON answers, and each `data:` event of a
stream against the operation's event schema; a refused body validates against the error schema.
Run by tests/tests/openapi.rs with LOCKSTEP_URL and LOCKSTEP_MODEL set (LOCKSTEP_EMBEDDINGS=1:
the model embeds). Exits non-zero on the first failed check."""

import json
import os
import sys

import requests
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_spec

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
EMBEDS = os.environ.get("LOCKSTEP_EMBEDDINGS") == "1"
S = requests.Session()


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


spec = S.get(URL + "/openapi.json", timeout=30).json()
validate_spec(spec)
check(spec["openapi"].startswith("3.1"), "a valid OpenAPI 3.1 document")


def validator(schema):
    if isinstance(schema, bool):  # `true`: any value
        schema = {} if schema else {"not": {}}
    return Draft202012Validator({**schema, "components": spec["components"]})


def valid(schema, value, what):
    errors = sorted(validator(schema).iter_errors(value), key=lambda e: list(e.path))
    check(not errors, f"{what}: " + ("; ".join(f"{list(e.path)}: {e.message}" for e in errors[:3]) or "valid"))


def sse_payloads(text):
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            d = line[5:].strip()
            if d != "[DONE]":
                out.append(json.loads(d))
    return out


def conforms(method, path, r, op):
    """The answer `r` of operation `op` against the document."""
    what = f"{method.upper()} {path} -> {r.status_code}"
    check(r.status_code != 405, f"{what}: the method is served")
    if r.status_code == 404:
        message = r.json().get("error", {}).get("message", "")
        check(not message.startswith("no route for"), f"{what}: the route is served ({message})")
    status = "200" if r.status_code == 200 else ("4XX" if r.status_code < 500 else "5XX")
    doc = op["responses"][status]
    ctype = r.headers.get("content-type", "").split(";")[0]
    check(ctype in doc["content"], f"{what}: content type {ctype} documented ({list(doc['content'])})")
    media = doc["content"][ctype]
    if ctype == "application/json":
        valid(media["schema"], r.json(), f"{what} body")
    elif ctype == "text/event-stream":
        events = sse_payloads(r.text)
        check(events, f"{what}: events")
        for i, e in enumerate(events):
            valid(media["x-event-schema"], e, f"{what} event {i}")
    else:
        check(isinstance(r.text, str) and r.text, f"{what}: text")


def call(method, path, **kw):
    return S.request(method, URL + path, timeout=60, **kw)


state = {}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
chat = {"model": MODEL, "messages": [{"role": "user", "content": "alpha bravo"}], "max_tokens": 4}


def responses_create():
    r = call("post", "/v1/responses", json={"model": MODEL, "input": "charlie", "max_output_tokens": 3,
                                             "background": True})
    state["resp"] = r.json()["id"]
    for _ in range(200):
        if call("get", f"/v1/responses/{state['resp']}").json()["status"] not in ("queued", "in_progress"):
            break
    return r


def conversation_create():
    r = call("post", "/v1/conversations", json={"metadata": {"k": "v"},
                                                 "items": [{"role": "user", "content": "delta"}]})
    state["conv"] = r.json()["id"]
    items = call("get", f"/v1/conversations/{state['conv']}/items").json()
    state["item"] = items["data"][0]["id"]
    return r


# Every operation: its calls (whole and streamed where it streams), in an order that creates what
# later ones read. Each returns the answers to check.
SAMPLES = {
    ("post", "/v1/chat/completions"): lambda: [
        call("post", "/v1/chat/completions", json=chat),
        call("post", "/v1/chat/completions", json={**chat, "stream": True,
                                                   "stream_options": {"include_usage": True}}),
        call("post", "/v1/chat/completions", json={**chat, "frequency_of_nonsense": 1}),
        call("post", "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}),
        call("post", "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2, "stream": True}),
    ] + ([
        # A forced tool call (lockstep's engine constrains it), whole and streamed.
        call("post", "/v1/chat/completions", json={**chat, "max_tokens": 40, "tool_choice": "required",
                                                   "tools": TOOLS}),
        call("post", "/v1/chat/completions", json={**chat, "max_tokens": 40, "tool_choice": "required",
                                                   "tools": TOOLS, "stream": True}),
    ] if EMBEDS else []),
    ("post", "/v1/completions"): lambda: [
        call("post", "/v1/completions", json={"model": MODEL, "prompt": "echo", "max_tokens": 3}),
        call("post", "/v1/completions", json={"model": MODEL, "prompt": "echo", "max_tokens": 3, "stream": True}),
        call("post", "/v1/completions", json={"model": MODEL, "prompt": "echo", "max_tokens": 3, "logprobs": 2}),
    ],
    ("post", "/v1/messages"): lambda: [
        call("post", "/v1/messages", json={"model": MODEL, "max_tokens": 3,
                                           "messages": [{"role": "user", "content": "foxtrot"}]}),
        call("post", "/v1/messages", json={"model": MODEL, "max_tokens": 3, "stream": True,
                                           "messages": [{"role": "user", "content": "foxtrot"}]}),
        call("post", "/v1/messages", json={"model": MODEL}),
    ],
    ("post", "/v1/responses"): lambda: [
        responses_create(),
        call("post", "/v1/responses", json={"model": MODEL, "input": "golf", "max_output_tokens": 3,
                                             "stream": True}),
        call("post", "/v1/responses", json={"model": MODEL, "input": "hotel", "max_output_tokens": 3,
                                             "previous_response_id": state["resp"]}),
    ],
    ("post", "/generate"): lambda: [
        call("post", "/generate", json={"text": "india", "sampling_params": {"max_new_tokens": 3}}),
        call("post", "/generate", json={"text": "india", "sampling_params": {"max_new_tokens": 3}, "stream": True}),
        call("post", "/generate", json={"text": "india", "sampling_params": {"max_new_tokens": 3},
                                        "return_logprob": True, "top_logprobs_num": 2}),
    ],
    ("post", "/v1/embeddings"): lambda: [
        call("post", "/v1/embeddings", json={"model": MODEL, "input": "juliet"}),
    ],
    ("get", "/ready"): lambda: [call("get", "/ready")],
    ("get", "/v1/models"): lambda: [call("get", "/v1/models")],
    ("post", "/tokenize"): lambda: [
        call("post", "/tokenize", json={"model": MODEL, "prompt": "kilo", "return_token_strs": True}),
        call("post", "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "kilo"}]}),
    ],
    ("post", "/detokenize"): lambda: [call("post", "/detokenize", json={"model": MODEL, "tokens": [1, 2, 3]})],
    ("get", "/tokenizer_info"): lambda: [call("get", "/tokenizer_info")],
    ("get", "/v1/responses/{id}"): lambda: [
        call("get", f"/v1/responses/{state['resp']}"),
        call("get", f"/v1/responses/{state['resp']}?stream=true&starting_after=1"),
        call("get", "/v1/responses/resp_unknown"),
    ],
    ("get", "/v1/responses/{id}/input_items"): lambda: [call("get", f"/v1/responses/{state['resp']}/input_items")],
    ("post", "/v1/responses/{id}/cancel"): lambda: [call("post", f"/v1/responses/{state['resp']}/cancel")],
    ("post", "/v1/conversations"): lambda: [conversation_create()],
    ("get", "/v1/conversations/{id}"): lambda: [call("get", f"/v1/conversations/{state['conv']}")],
    ("post", "/v1/conversations/{id}"): lambda: [
        call("post", f"/v1/conversations/{state['conv']}", json={"metadata": {"k": "w"}})],
    ("get", "/v1/conversations/{id}/items"): lambda: [call("get", f"/v1/conversations/{state['conv']}/items")],
    ("post", "/v1/conversations/{id}/items"): lambda: [
        call("post", f"/v1/conversations/{state['conv']}/items", json={"items": [{"role": "user", "content": "lima"}]})],
    ("get", "/v1/conversations/{id}/items/{item_id}"): lambda: [
        call("get", f"/v1/conversations/{state['conv']}/items/{state['item']}")],
    ("delete", "/v1/conversations/{id}/items/{item_id}"): lambda: [
        call("delete", f"/v1/conversations/{state['conv']}/items/{state['item']}")],
    ("delete", "/v1/conversations/{id}"): lambda: [call("delete", f"/v1/conversations/{state['conv']}")],
    ("delete", "/v1/responses/{id}"): lambda: [call("delete", f"/v1/responses/{state['resp']}")],
    ("get", "/health"): lambda: [call("get", "/health")],
    ("get", "/openapi.json"): lambda: [call("get", "/openapi.json")],
    ("get", "/metrics"): lambda: [call("get", "/metrics")],
}

documented = {(m, p) for p, item in spec["paths"].items() for m in item}
check(documented == set(SAMPLES), f"every documented operation has a sample and the reverse: "
      f"{sorted(documented ^ set(SAMPLES))}")
for (method, path), sample in SAMPLES.items():
    op = spec["paths"][path][method]
    for r in sample():
        if path == "/v1/embeddings" and EMBEDS:
            check(r.status_code == 200, f"embeddings answered: {r.status_code} {r.text[:200]}")
        conforms(method, path, r, op)
        if path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses/{id}") and \
                "unknown" not in r.url and "nonsense" not in (r.request.body or b"").decode():
            check(r.status_code == 200, f"{method} {r.url} answered 200: {r.status_code} {r.text[:200]}")

# A route that is not documented is not served.
r = call("get", "/v1/undocumented")
check(r.status_code == 404 and r.json()["error"]["message"].startswith("no route for"),
      "an undocumented path is a 404")
print("all openapi checks passed")
