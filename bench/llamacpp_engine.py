"""llama.cpp (llama-cpp-python) throughput on a GGUF model, the same measurements as
gpu-engine/examples/bench_model.rs: prefill tokens/s on a 512-token prompt, decode tokens/s at
batch 1 and batch 8 (each sequence after a 512-token prompt), each in the context a user would
give it: prefill and batch 1 in a single-sequence context (`n_ctx` 1024, as `Llama(n_ctx=1024)`
makes), batch 8 in one made for eight sequences (a context for eight slows batch 1 by 8-15%).
`BENCH_CONTEXT=N` (under 512) runs the batch-1 decode after an N-token prompt instead and
`BENCH_STEPS` sets its step count (default 64); `BENCH_REPS` the repetitions (3), best kept: as
bench_model reads them. Prints one JSON line.

    python bench/llamacpp_engine.py MODEL.gguf THREADS
"""
import ctypes
import json
import os
import sys
import time

import llama_cpp

path, threads = sys.argv[1], int(sys.argv[2])
reps = int(os.environ.get("BENCH_REPS", 3))
context_len = min(max(int(os.environ.get("BENCH_CONTEXT", 512)), 1), 512)
steps = int(os.environ.get("BENCH_STEPS", 64))
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=threads, verbose=False)
prompt = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 60, add_bos=False)[:512]


def context(n_ctx, n_seq):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = 512
    params.n_ubatch = 512
    params.n_seq_max = n_seq
    params.n_threads = threads
    params.n_threads_batch = threads
    return llama_cpp.llama_init_from_model(llm._model.model, params)


# Prefill and batch 1: one sequence; batch 8: eight sequences of 640 positions each.
ctx1, ctx8 = context(1024, 1), context(8 * 640, 8)
batch = llama_cpp.llama_batch_init(512, 0, 8)


def decode(ctx, tokens, seq, start, logits_last=True):
    batch.n_tokens = len(tokens)
    for i, (t, s, p) in enumerate(zip(tokens, seq, start)):
        batch.token[i] = t
        batch.pos[i] = p
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = s
        batch.logits[i] = logits_last and (i == len(tokens) - 1 or len(set(seq)) > 1)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise SystemExit(f"llama_decode failed: {len(tokens)} tokens, seqs {sorted(set(seq))}, pos {start[0]}")


def clear(ctx):
    mem = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(mem, True)


pre, d1, d8 = [], [], []
for _ in range(reps):
    clear(ctx1)
    t = time.perf_counter()
    decode(ctx1, prompt, [0] * 512, range(512))
    pre.append(512 / (time.perf_counter() - t))
    if context_len < 512:
        clear(ctx1)
        decode(ctx1, prompt[:context_len], [0] * context_len, range(context_len))
    t = time.perf_counter()
    for i in range(steps):
        decode(ctx1, [prompt[i % 512]], [0], [context_len + i])
    d1.append(steps / (time.perf_counter() - t))
    clear(ctx8)
    for s in range(8):
        decode(ctx8, prompt, [s] * 512, range(512))
    t = time.perf_counter()
    for i in range(32):
        decode(ctx8, [prompt[i]] * 8, list(range(8)), [512 + i] * 8)
    d8.append(8 * 32 / (time.perf_counter() - t))
print(json.dumps({"prefill512_tok_s": round(max(pre), 1), "decode_b1_tok_s": round(max(d1), 1),
                  "decode_b8_tok_s": round(max(d8), 1), "llama_cpp_python": llama_cpp.__version__}))
