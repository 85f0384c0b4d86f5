"""A third-party gRPC client (Python grpcio, no generated stubs) against lockstep's gRPC front end:
it discovers the services and message types through server reflection, calls Generate and Chat
streamed, reads error details (google.rpc.ErrorInfo), checks health, and aborts and cancels pairs.
Run by tests/tests/grpc.rs with LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero on the first
failed check."""

import json
import os
import sys
import time
import urllib.request

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
TARGET = URL.removeprefix("http://")


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


channel = grpc.insecure_channel(TARGET)
grpc.channel_ready_future(channel).result(timeout=10)

# Reflection: the services, and every message type, from the server itself.
db = ProtoReflectionDescriptorDatabase(channel)
services = set(db.get_services())
for s in ["lockstep.v1.Lockstep", "grpc.health.v1.Health"]:
    check(s in services, f"reflection lists {s} ({sorted(services)})")
pool = descriptor_pool.DescriptorPool(db)
svc = pool.FindServiceByName("lockstep.v1.Lockstep")
check("lockstep.v1.Worker" not in services, "the internal worker service is not advertised")
methods = {m.name for m in svc.methods}
check({"Generate", "Chat", "Abort", "GetPair", "ListModels"} <= methods, f"Lockstep methods {sorted(methods)}")


def msg(name):
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def method(name, req_type, resp_type, streaming):
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(f"/lockstep.v1.Lockstep/{name}", request_serializer=msg(req_type).SerializeToString,
                response_deserializer=msg(resp_type).FromString)


GenerateRequest, ChatRequest, Sampling = msg("lockstep.v1.GenerateRequest"), msg("lockstep.v1.ChatRequest"), msg(
    "lockstep.v1.SamplingParams")
generate = method("Generate", "lockstep.v1.GenerateRequest", "lockstep.v1.GenerateResponse", True)
chat = method("Chat", "lockstep.v1.ChatRequest", "lockstep.v1.GenerateResponse", True)
abort = method("Abort", "lockstep.v1.AbortRequest", "lockstep.v1.AbortResponse", False)
get_pair = method("GetPair", "lockstep.v1.GetPairRequest", "lockstep.v1.PairInfo", False)
list_models = method("ListModels", "lockstep.v1.ListModelsRequest", "lockstep.v1.ListModelsResponse",
                     False)

# Health.
HealthReq = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest"))
HealthResp = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse"))
health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=HealthReq.SerializeToString,
                             response_deserializer=HealthResp.FromString)
for name in ["", "lockstep.v1.Lockstep"]:
    h = health(HealthReq(service=name), timeout=5)
    check(HealthResp.ServingStatus.Name(h.status) == "SERVING", f"health of {name!r} is SERVING")

models = [m.name for m in list_models(msg("lockstep.v1.ListModelsRequest")(), timeout=5).models]
check(MODEL in models, f"ListModels {models}")

# Generate, streamed: started, deltas, finished; the same text as the HTTP API gives (greedy).
events = list(generate(GenerateRequest(model=MODEL, text="The capital of France is",
                                       sampling=Sampling(max_tokens=8, temperature=0)), timeout=60))
kinds = [e.WhichOneof("event") for e in events]
check(kinds[0] == "started" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"delta"}, f"event order {kinds}")
started, finished = events[0].started, events[-1].finished
text = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
ids = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
check(started.prompt_tokens == 5 and started.pair_id.isdigit(), f"started {started}")
check(finished.usage.completion_tokens == 8 == len(ids), f"usage {finished.usage} and {len(ids)} token ids")
check(msg("lockstep.v1.Finished").DESCRIPTOR.fields_by_name["finish_reason"].enum_type.values_by_number[
          finished.finish_reason].name == "FINISH_REASON_LENGTH", "finish reason length")
body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
http = json.load(urllib.request.urlopen(urllib.request.Request(
    URL + "/v1/completions", data=body, headers={"content-type": "application/json"}), timeout=60))
check(http["choices"][0]["text"] == text and "Paris" in text, f"gRPC text equals HTTP text: {text!r}")

# Token ids in, text out.
events = list(generate(GenerateRequest(model=MODEL, input_ids=msg("lockstep.v1.TokenIds")(ids=ids[:3]),
                                       sampling=Sampling(max_tokens=2, temperature=0)), timeout=60))
check(events[0].started.prompt_tokens == 3, "input_ids prompt")

# Chat.
Message = msg("lockstep.v1.ChatMessage")
events = list(chat(ChatRequest(model=MODEL, messages=[Message(role="user", content="Say hello.")],
                               sampling=Sampling(max_tokens=6, temperature=0)), timeout=60))
answer = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
check(events[-1].WhichOneof("event") == "finished" and answer.strip(), f"chat answer {answer!r}")


def error_of(call):
    try:
        for _ in call():
            pass
    except grpc.RpcError as e:
        status = rpc_status.from_call(e)
        info = None
        for d in status.details if status else []:
            if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                d.Unpack(info)
        return e.code(), info
    return None, None


# Errors: a gRPC status plus ErrorInfo with the stable code.
code, info = error_of(lambda: generate(GenerateRequest(model="nope", text="x"), timeout=10))
check(code == grpc.StatusCode.NOT_FOUND and info.reason == "model_not_found" and info.domain == "lockstep",
      f"unknown model: {code} {info}")
code, info = error_of(lambda: generate(GenerateRequest(model=MODEL, text="word " * 600,
                                                       sampling=Sampling(max_tokens=8)), timeout=10))
check(code == grpc.StatusCode.INVALID_ARGUMENT and info.reason == "context_length_exceeded",
      f"over-long prompt: {code} {info}")
code, info = error_of(lambda: generate(GenerateRequest(model=MODEL, text="x", sampling=Sampling(temperature=5)),
                                       timeout=10))
check(code == grpc.StatusCode.INVALID_ARGUMENT and info.reason == "invalid_request" and
      info.metadata["param"] == "temperature", f"bad temperature: {code} {info}")
code, info = error_of(lambda: generate(GenerateRequest(model=MODEL), timeout=10))
check(code == grpc.StatusCode.INVALID_ARGUMENT and info.metadata["param"] == "prompt", f"no prompt: {code}")
code, info = error_of(lambda: list(generate(GenerateRequest(model=MODEL, text="x", sampling=Sampling(logprobs=21)),
                                            timeout=10)))
check(code == grpc.StatusCode.INVALID_ARGUMENT and info.metadata["param"] == "logprobs", f"logprobs 21: {code}")

# Log-probabilities: one per token id, two alternatives each, the greedy token the most likely,
# the tokens' bytes the text's; the values the HTTP API gives for the same request.
events = list(generate(GenerateRequest(model=MODEL, text="The capital of France is",
                                       sampling=Sampling(max_tokens=6, temperature=0, logprobs=2)), timeout=60))
deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
lps = [lp for d in deltas for lp in d.logprobs]
check(all(len(d.logprobs) == len(d.token_ids) for d in deltas) and len(lps) == 6, f"one entry per token ({len(lps)})")
check([lp.token_id for lp in lps] == [t for d in deltas for t in d.token_ids], "entries follow the token ids")
check(all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob for lp in lps),
      "greedy: the token is the most likely of two")
check(b"".join(lp.token for lp in lps) == "".join(d.text for d in deltas).encode(), "the tokens' bytes make the text")
body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                   "logprobs": 2}).encode()
http = json.load(urllib.request.urlopen(urllib.request.Request(
    URL + "/v1/completions", data=body, headers={"content-type": "application/json"}), timeout=60))
check(all(abs(a - lp.logprob) < 1e-5 for a, lp in zip(http["choices"][0]["logprobs"]["token_logprobs"], lps)),
      "gRPC log-probabilities equal HTTP's")


def wait_gone(pair_id):
    """GetPair answers NOT_FOUND once the pair has ended (bounded wait)."""
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            get_pair(msg("lockstep.v1.GetPairRequest")(pair_id=pair_id), timeout=5)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return True
        time.sleep(0.05)
    return False


LONG = Sampling(max_tokens=200, temperature=0, ignore_eos=True)

# Abort: the pair's own client aborts it mid-stream; the stream ends in an error, the pair is gone.
stream = generate(GenerateRequest(model=MODEL, text="Count from one to one hundred:", sampling=LONG), timeout=120)
first = next(stream)
pair_id = first.started.pair_id
info = get_pair(msg("lockstep.v1.GetPairRequest")(pair_id=pair_id), timeout=5)
check(info.model == MODEL and info.state == "committed", f"GetPair {info.state}")
# Workers by label, never by address.
check((info.prefill_worker, info.decode_worker) == ("prefill-0", "decode-0"),
      f"GetPair workers {info.prefill_worker!r} {info.decode_worker!r}")
r = abort(msg("lockstep.v1.AbortRequest")(pair_id=pair_id), timeout=5)
try:
    rest = list(stream)
    check(False, f"an aborted stream ends in an error (got {len(rest)} more events)")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.UNAVAILABLE, f"aborted stream: {e.code()} {e.details()}")
check(wait_gone(pair_id), "aborted pair is gone")
code, _ = error_of(lambda: [abort(msg("lockstep.v1.AbortRequest")(pair_id=pair_id), timeout=5)])
check(code == grpc.StatusCode.NOT_FOUND, f"aborting it again: {code}")

# Cancel: the client cancels the call; the pair is aborted on both halves.
stream = generate(GenerateRequest(model=MODEL, text="Count from one to one hundred:", sampling=LONG), timeout=120)
pair_id = next(stream).started.pair_id
stream.cancel()
check(wait_gone(pair_id), "cancelled call's pair is gone")

# Deadline: grpc-timeout bounds the pair.
t0 = time.time()
stream = generate(GenerateRequest(model=MODEL, text="Count from one to one hundred:", sampling=LONG), timeout=1.5)
pair_id = None
try:
    for e in stream:
        if e.WhichOneof("event") == "started":
            pair_id = e.started.pair_id
    check(False, "the deadline ends the stream")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.time() - t0 < 10, f"deadline: {e.code()}")
check(pair_id is None or wait_gone(pair_id), "the deadline's pair is gone")

print("all grpc checks passed")
