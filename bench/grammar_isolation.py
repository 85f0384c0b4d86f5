#!/usr/bin/env python3
"""What a costly structured-output request does to another tenant's stream, on the embedded engine.

    python3 bench/grammar_isolation.py BIN [BIN...] [--rounds N]

For each lockstep binary (say the build before a change and after it), alternated round by round:
`BIN serve` with config/default.toml on a free port; tenant A streams a greedy 96-token completion
and its inter-token gaps are recorded, first alone ("quiet"), then while tenant B sends chat
requests with a costly JSON schema back to back ("schema"). Printed per binary: A's median and
p99 gap in both phases (medians over the rounds), and the schema phase's p99 over the quiet one.
Processes are stopped by pid; every request is bounded in time.
"""

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"

# Costly for a grammar compiler (llguidance): ambiguous alternations under large counted
# repetitions, a few hundred ms each to compile on this CPU where a plain schema takes a few.
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "pattern": "^(a|b|ab|ba){1,500}c{1,500}$"},
        "b": {"type": "string", "pattern": "^(x|y|xy|yx){1,400}z{1,400}$"},
        "c": {"type": "string", "pattern": "^(0|1|01|10){1,300}2{1,300}$"},
    },
    "required": ["a", "b", "c"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body, timeout=120):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def start(binary, port, workdir):
    text = open(os.path.join(ROOT, "config/default.toml")).read()
    text = text.replace('http_listen = "127.0.0.1:8080"', f'http_listen = "127.0.0.1:{port}"')
    cfg = os.path.join(workdir, f"lockstep-{port}.toml")
    with open(cfg, "w") as f:
        f.write(text)
    log = open(os.path.join(workdir, f"lockstep-{port}.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with post(port, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}, 10) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{binary} did not start; see {log.name}")


def stream_gaps(port):
    """Tenant A: one streamed greedy completion; the gaps between its chunks, seconds."""
    body = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 96,
            "temperature": 0, "stream": True, "ignore_eos": True}
    gaps, last = [], None
    with post(port, "/v1/completions", body) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def tenant_b(port, stop, sent):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Fill the form."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": SCHEMA}}}
    while not stop.is_set():
        try:
            with post(port, "/v1/chat/completions", body, 60) as r:
                r.read()
        except OSError:
            pass
        sent[0] += 1


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def main():
    args = sys.argv[1:]
    rounds = 3
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    binaries = args
    if not binaries:
        raise SystemExit(__doc__)
    results = {b: {"quiet": [], "schema": [], "sent": 0} for b in binaries}
    with tempfile.TemporaryDirectory() as work:
        for rnd in range(rounds):
            for b in binaries:
                port = free_port()
                proc = start(b, port, work)
                try:
                    stream_gaps(port)  # warm-up
                    quiet = stream_gaps(port)
                    stop, sent = threading.Event(), [0]
                    t = threading.Thread(target=tenant_b, args=(port, stop, sent), daemon=True)
                    t.start()
                    time.sleep(0.2)
                    loaded = stream_gaps(port)
                    stop.set()
                    t.join(timeout=90)
                    r = results[b]
                    r["quiet"].append((statistics.median(quiet), p99(quiet)))
                    r["schema"].append((statistics.median(loaded), p99(loaded)))
                    r["sent"] += sent[0]
                    print(f"round {rnd + 1} {b}: quiet p50 {quiet and statistics.median(quiet) * 1e3:.1f} ms "
                          f"p99 {p99(quiet) * 1e3:.1f} ms; with schemas p50 {statistics.median(loaded) * 1e3:.1f} ms "
                          f"p99 {p99(loaded) * 1e3:.1f} ms max {max(loaded) * 1e3:.1f} ms ({sent[0]} schema requests)",
                          flush=True)
                finally:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    print()
    print(f"{'binary':<48} {'quiet p50':>10} {'quiet p99':>10} {'schema p50':>11} {'schema p99':>11} {'p99 ratio':>10}")
    for b, r in results.items():
        q50 = statistics.median(x[0] for x in r["quiet"]) * 1e3
        q99 = statistics.median(x[1] for x in r["quiet"]) * 1e3
        s50 = statistics.median(x[0] for x in r["schema"]) * 1e3
        s99 = statistics.median(x[1] for x in r["schema"]) * 1e3
        print(f"{b:<48} {q50:>8.1f}ms {q99:>8.1f}ms {s50:>9.1f}ms {s99:>9.1f}ms {s99 / q99:>9.2f}x")


if __name__ == "__main__":
    main()
