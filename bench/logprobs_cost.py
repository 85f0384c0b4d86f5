"""What asking for log-probabilities costs a stream: streamed 256-token greedy completions from a
running lockstep (or any OpenAI-compatible server) without `logprobs` and with 0, 5 and 20, ROUNDS
rounds of one stream per setting in alternating order; prints each setting's median rate and
the median (min-max) of its per-round ratio to the stream without.

    python3 bench/logprobs_cost.py http://127.0.0.1:8080 [ROUNDS]
"""
import statistics
import sys

from sse_stream import text_times

URL = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6


def rate(lp):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 256,
            "temperature": 0, "ignore_eos": True, "stream": True}
    if lp is not None:
        body["logprobs"] = lp
    t = text_times(URL + "/v1/completions", body)
    return (len(t) - 1) / (t[-1] - t[0])


rate(None)  # warm-up, not measured
res = {None: [], 0: [], 5: [], 20: []}
for i in range(ROUNDS):
    for k in ([None, 0, 5, 20] if i % 2 == 0 else [20, 5, 0, None]):
        res[k].append(rate(k))
base = res[None]
for k in [0, 5, 20]:
    r = [a / b for a, b in zip(res[k], base)]
    print(f"logprobs={k}: {statistics.median(res[k]):.1f} tok/s vs {statistics.median(base):.1f} without; "
          f"per-round ratio median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")
