"""Single-stream greedy decode of two servers measured in pairs, for bench/llama_server.sh: both
servers are up (the idle one uses no CPU), and each pair is one 256-token stream on each, in
A B / B A order by turns so neither always goes first. On these VMs the CPU has slow phases of a
few seconds (the same program's CPU time per token rises by a third in them, llama-server's as
much as lockstep's), so two figures taken rounds apart compare phases as much as programs; two
streams seconds apart mostly share one. Prints the median rate of each and the median (min-max)
of the per-pair ratios, as one JSON line.

    python3 bench/paired_decode.py URL_A NAME_A URL_B NAME_B [PAIRS]
"""
import json
import statistics
import sys

from sse_stream import text_times

URL_A, NAME_A, URL_B, NAME_B = sys.argv[1:5]
PAIRS = int(sys.argv[5]) if len(sys.argv) > 5 else 12
MODEL = "SmolLM2-135M-Instruct"


def rate(base):
    """Tokens/s of one streamed 256-token completion, from its first text chunk to its last."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = text_times(base + "/v1/completions", body)
    return (len(times) - 1) / (times[-1] - times[0])


rate(URL_A), rate(URL_B)  # warm-up, not measured
a, b = [], []
for i in range(PAIRS):
    if i % 2 == 0:
        a.append(rate(URL_A))
        b.append(rate(URL_B))
    else:
        b.append(rate(URL_B))
        a.append(rate(URL_A))
ratios = [x / y for x, y in zip(a, b)]
print(json.dumps({NAME_A: round(statistics.median(a), 1), NAME_B: round(statistics.median(b), 1),
                  "pairs": PAIRS, "ratio_median": round(statistics.median(ratios), 3),
                  "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}))
