"""lockstep end to end through HTTP (stdlib client): time to first token for a 512-token prompt,
decode tokens/s of one streamed request, decode tokens/s after the 512-token prompt (the best of
3 streams, as bench_model reports the best of its repetitions), and aggregate tokens/s of 8
concurrent requests. Prints one JSON line. SEED (default 0) starts the 512-token prompt with its
own word, so runs with different seeds share no prompt page (no prefix cache serves the TTFT).

    python3 bench/e2e_http.py http://127.0.0.1:8080 MODEL [SEED]
"""
import json
import sys
import threading
import time

from sse_stream import events

BASE, MODEL = sys.argv[1], sys.argv[2]
SEED = int(sys.argv[3]) if len(sys.argv) > 3 else 0
# About 512 tokens (the template-free completion prompt); the seed's word first.
PROMPT_512 = " ".join([f"r{SEED}"] + ["fox"] * 509)


def stream(prompt, max_tokens):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage = None
    for ev in events(BASE + "/v1/completions", body):
        if ev.get("choices") and first is None:
            first = time.perf_counter()
        if ev.get("usage"):
            usage = ev["usage"]
    return t0, first, time.perf_counter(), usage


t0, first, end, usage = stream(PROMPT_512, 1)
ttft = first - t0
prompt_tokens = usage["prompt_tokens"]
t0, first, end, usage = stream("Once upon a time", 128)
decode_b1 = (usage["completion_tokens"] - 1) / (end - first)
# Decode at the engine benchmark's positions (after a 512-token prompt, 64 steps): the serving
# path's share of the engine's own batch-1 figure. The best of 3, as bench_model takes the best of
# its repetitions (the same statistic on both sides).
decode_after_512 = 0.0
for _ in range(3):
    t0, first, end, usage = stream(PROMPT_512, 65)
    decode_after_512 = max(decode_after_512, (usage["completion_tokens"] - 1) / (end - first))
results = []
threads = [threading.Thread(target=lambda: results.append(stream("Once upon a time", 64))) for _ in range(8)]
t = time.perf_counter()
for th in threads:
    th.start()
for th in threads:
    th.join()
total = sum(r[3]["completion_tokens"] for r in results)
print(json.dumps({"ttft_512_s": round(ttft, 3), "prompt_tokens": prompt_tokens,
                  "prefill_e2e_tok_s": round(prompt_tokens / ttft, 1), "decode_b1_tok_s": round(decode_b1, 1),
                  "decode_after512_tok_s": round(decode_after_512, 1),
                  "concurrent8_tok_s": round(total / (time.perf_counter() - t), 1)}))
