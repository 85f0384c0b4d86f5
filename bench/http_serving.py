"""One round of bench/llama_server.sh against one server (OpenAI `/v1/completions`, streamed,
stdlib client): single-stream greedy decode tokens/s (256 tokens, `ignore_eos`; the time from the
first token to the last), time to first token on ~512-token prompts that share no prefix with
anything the server saw (3 prompts, median; new words in every round and for every server), and
the aggregate tokens/s of 8 concurrent 64-token streams. Prints one JSON line.

    python3 bench/http_serving.py http://127.0.0.1:8080 lockstep 1
"""
import json
import random
import statistics
import sys
import threading
import time

from sse_stream import text_times

BASE, WHO, ROUND = sys.argv[1], sys.argv[2], int(sys.argv[3])
MODEL = "SmolLM2-135M-Instruct"
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force").split()
# Seeded by round and server, so no prompt repeats anywhere (no prefix cache can serve it).
RNG = random.Random(ROUND * 1000 + (0 if WHO == "lockstep" else 500))


def stream(prompt, max_tokens):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = text_times(BASE + "/v1/completions", body)
    return t0, times


def unshared(n_words):
    return " ".join(RNG.choice(WORDS) for _ in range(n_words))


# Warm-up (not measured).
stream("Hello", 8)
_, times = stream("Once upon a time", 256)
decode = (len(times) - 1) / (times[-1] - times[0])
ttfts = []
for _ in range(3):
    t0, times = stream(unshared(500), 2)
    ttfts.append((times[0] - t0) * 1000)
done = []


def one(i):
    _, times = stream(f"Story {ROUND}-{i}: once upon a time", 64)
    done.append(len(times))


t0 = time.perf_counter()
threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
conc = sum(done) / (time.perf_counter() - t0)
print(json.dumps({"who": WHO, "round": ROUND, "decode_tok_s": decode,
                  "ttft_ms": statistics.median(ttfts), "conc8_tok_s": conc}))
