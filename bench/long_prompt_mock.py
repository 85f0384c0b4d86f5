"""Upstream mock for bench/long_prompts.sh: one worker (prefill or decode) of an SGLang or vLLM
PD pair, answering at once with one token and the prompt count it was sent: the length of
`input_ids` when the body has them (what lockstep sends, and what its commit barrier checks),
else the body's bytes / 4 (a text prompt; the gateways do not check it). It never parses the
JSON: it counts commas in the `input_ids` array, so its cost per request is about the same for
every router in front of it. HTTP/1.1 keep-alive, one thread per connection. A benchmark part,
not a test double: the tests use tests/src/sglang_mock.rs and vllm_mock.rs.

    python3 bench/long_prompt_mock.py sglang|vllm prefill|decode PORT
"""
import http.server
import json
import re
import sys

kind, role, port = sys.argv[1], sys.argv[2], int(sys.argv[3])

# /server_info as SGLang 0.5.23 answers it (the keys lockstep's deployment check reads), with
# room for 1 Mi-token prompts.
INFO = {"disaggregation_mode": role, "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": 8998, "disaggregation_enable_kv_checksum": True,
        "incremental_streaming_output": False, "skip_tokenizer_init": False, "page_size": 1,
        "kv_cache_dtype": "auto", "tp_size": 1, "pp_size": 1, "model_path": "smollm2",
        "tokenizer_path": "smollm2", "is_generation": True, "max_total_num_tokens": 4_000_000,
        "max_req_input_len": 3_999_994}
STREAM = re.compile(rb'"stream"\s*:\s*true')


def prompt_count(body):
    i = body.find(b'"input_ids"')
    if i < 0:
        return len(body) // 4
    j = body.index(b"[", i)
    k = body.index(b"]", j)
    return body.count(b",", j, k) + 1 if body[j + 1:k].strip() else 0


def answer(path, n, stream):
    usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
    if path == "/generate":
        return {"text": "hello", "output_ids": [1],
                "meta_info": {"prompt_tokens": n, "completion_tokens": 1, "cached_tokens": 0,
                              "finish_reason": {"type": "length", "length": 1}}}
    chat = path.endswith("/chat/completions")
    if stream:
        choice = {"index": 0, "delta": {"content": "hello"}} if chat else {"index": 0, "text": "hello"}
        choice["finish_reason"] = "length"
        obj = {"id": "c", "object": "chat.completion.chunk" if chat else "text_completion",
               "model": "smollm2", "choices": [choice], "usage": usage}
    else:
        choice = ({"index": 0, "message": {"role": "assistant", "content": "hello"}} if chat
                  else {"index": 0, "text": "hello", "logprobs": None})
        choice["finish_reason"] = "length"
        obj = {"id": "c", "object": "chat.completion" if chat else "text_completion",
               "model": "smollm2", "choices": [choice], "usage": usage}
    if kind == "vllm" and role == "prefill":
        obj["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                     "remote_block_ids": [0], "remote_engine_id": "e",
                                     "remote_host": "127.0.0.1", "remote_port": 5600,
                                     "remote_request_id": "r", "tp_size": 1}
    return obj


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY the second waits for the
    # client's delayed ACK (40 ms).
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def send(self, status, ctype, data):
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        # Gateways register a worker under the model its /v1/models names.
        if self.path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": "smollm2", "object": "model"}]}
        else:
            body = INFO if kind == "sglang" else {}
        self.send(200, "application/json", json.dumps(body).encode())

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        stream = STREAM.search(body) is not None
        obj = answer(self.path.split("?")[0], prompt_count(body), stream)
        if stream:
            self.send(200, "text/event-stream",
                      f"data: {json.dumps(obj)}\n\ndata: [DONE]\n\n".encode())
        else:
            self.send(200, "application/json", json.dumps(obj).encode())


http.server.ThreadingHTTPServer.daemon_threads = True
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
