"""What offering tools costs a stream that answers in text: streamed 256-token greedy chats from a
running lockstep (or any OpenAI-compatible server) without `tools` and with one tool under
`tool_choice: auto` (on a model without a tool parser: generic tool calls, the answer sampled
under the text-or-calls grammar, a mask per token), ROUNDS rounds in alternating order. The rate
is the decode's, first content event to last (the tools' longer prompt is not counted); prints
each setting's median rate and the median (min-max) of the per-round ratio.

    python3 bench/tools_cost.py http://127.0.0.1:8080 [ROUNDS]
"""
import statistics
import sys
import time

from sse_stream import events

URL = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def rate(with_tools):
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 256, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    if with_tools:
        body["tools"] = TOOLS
    t = [time.perf_counter() for ev in events(URL + "/v1/chat/completions", body)
         if any((c.get("delta") or {}).get("content") for c in ev.get("choices") or [])]
    return (len(t) - 1) / (t[-1] - t[0])


rate(False)  # warm-up, not measured
res = {False: [], True: []}
for i in range(ROUNDS):
    for w in ([False, True] if i % 2 == 0 else [True, False]):
        res[w].append(rate(w))
r = [a / b for a, b in zip(res[True], res[False])]
print(f"tools (auto, text answer): {statistics.median(res[True]):.1f} tok/s vs {statistics.median(res[False]):.1f} "
      f"without; per-round ratio median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")
