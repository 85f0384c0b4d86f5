"""Client of bench/long_prompts.sh: long chat prompts (a system prompt of 16 KiB, 128 KiB or
1 MiB of English-like text, then a short question) through each router, one at a time, on
keep-alive connections, after a warm-up (WARMUP) that is not measured. Per router and size: the median latency, the latency it adds over the
same request sent straight to the decode mock, and its CPU time per request (user + system of its
process tree, from /proc). Unique prompts (a new text every request) and a repeated prefix (the
same system prompt, a new question). Then, for lockstep, short requests' p99 alone and while
128 KiB prompts keep arriving on another connection, and with LONG_PROMPTS_CONTROL=URL while
they go to that lockstep instead (an idle-priority one: the floor the machine sets), the
conditions taking turns in short blocks. Prints markdown tables.

    python3 bench/long_prompts.py DIRECT_URL NAME=URL=PID[=HEADER] ...
"""
import http.client
import json
import os
import statistics
import sys
import multiprocessing
import time
import urllib.parse

WORDS = ["the", "router", "pairs", "prefill", "and", "decode", "halves", "of", "every",
         "request", "tenant", "cache,", "12", "never", "leaks.", "Ünïcode"]
# (label, bytes, requests measured): after one more that warms each router up (not counted).
SIZES = [("16 KiB", 16 << 10, 21), ("128 KiB", 128 << 10, 21), ("1 MiB", 1 << 20, 7)]
# Unique prompts of each size every router (and the direct mock) takes before anything is
# measured, so each is measured in its steady state: an allocator's heap grows to what these
# bodies need over the first hundreds of requests (lockstep's by about 40 MB, its p50 at
# 128 KiB falling from about 2.1 to 1.6 ms on the way), as a long-running router's has.
WARMUP = {16 << 10: 200, 128 << 10: 200, 1 << 20: 30}
TICK = os.sysconf("SC_CLK_TCK")
SHORTS = 4000  # short requests per condition (alone, loaded, control): enough for a stable p99
BLOCKS = 20  # blocks per condition in the short-request measurement


def prose(seed, n):
    x, out, size = 2 * seed + 1, [], 0  # odd and distinct for every seed
    mask = (1 << 64) - 1
    while size < n:
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        w = WORDS[x % 16] + ("\n" if x % 11 == 0 else " ")
        out.append(w)
        size += len(w.encode())
    return "".join(out)


def body(system, q):
    return json.dumps({"model": "smollm2", "max_tokens": 1, "stream": False, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Question {q}: what does it say?"}]}).encode()


class Target:
    def __init__(self, spec):
        parts = spec.split("=")
        self.name, url = parts[0], parts[1]
        self.pid = int(parts[2]) if len(parts) > 2 and parts[2] else None
        self.headers = {"content-type": "application/json"}
        if len(parts) > 3:
            self.headers["authorization"] = "Bearer " + parts[3]
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port
        self.conn = None

    def post(self, data):
        for attempt in range(2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
                t = time.perf_counter()
                self.conn.request("POST", "/v1/chat/completions", data, self.headers)
                r = self.conn.getresponse()
                out = r.read()
                dt = time.perf_counter() - t
                if r.status != 200:
                    raise SystemExit(f"{self.name}: {r.status} {out[:300]!r}")
                return dt
            except (ConnectionError, http.client.HTTPException):
                self.conn = None
                if attempt:
                    raise

    def cpu(self):
        """CPU seconds of the process and its descendants."""
        if self.pid is None:
            return 0.0
        kids, total = {self.pid}, 0
        stats = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        s = f.read().rsplit(")", 1)[1].split()
                    stats[int(d)] = (int(s[1]), int(s[11]) + int(s[12]))
                except OSError:
                    pass
        grew = True
        while grew:
            grew = False
            for p, (ppid, _) in stats.items():
                if ppid in kids and p not in kids:
                    kids.add(p)
                    grew = True
        for p in kids:
            total += stats.get(p, (0, 0))[1]
        return total / TICK


def measure(t, bodies):
    c0 = t.cpu()
    lat = [t.post(b) for b in bodies]
    return statistics.median(lat), (t.cpu() - c0) / len(bodies)


def background(spec, ready, go, stop, busy, sent):
    # The load's client is not the router: on these two shared cores it runs only on time the
    # router leaves idle (SCHED_IDLE; nice +10 where that is refused), as a client on another
    # machine would.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        os.nice(10)
    t = Target(spec)
    bodies = [body(prose(90_000 + i, 128 << 10), i) for i in range(40)]
    ready.set()
    i = 0
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        busy.value = 1
        if go.is_set():
            # A new system prompt each time (a number in front), so nothing is a cache hit.
            t.post(bodies[i % len(bodies)].replace(b'"content": "', f'"content": "{i} '.encode(), 1))
            i += 1
            sent.value = i
        busy.value = 0


def main():
    direct = Target("direct=" + sys.argv[1])
    targets = [Target(s) for s in sys.argv[2:]]
    seed = [1000]

    def unique(size, n):
        seed[0] += n
        return [body(prose(seed[0] + i, size), i) for i in range(n)]

    # LONG_PROMPTS_ONLY_LOADED=1: only the short-request measurement at the end.
    modes = () if os.environ.get("LONG_PROMPTS_ONLY_LOADED") else ("unique", "repeated")
    if modes:
        for size, n in WARMUP.items():
            warm = [body(prose(500_000 + size + i, size), i) for i in range(n)]
            for t in [direct, *targets]:
                for b in warm:
                    t.post(b)
    for mode in modes:
        print(f"\n### {mode} prompts\n")
        print("| prompt | " + " | ".join(f"{t.name}: added p50, CPU/req" for t in targets) + " | direct p50 |")
        print("| --- | " + " | ".join("---:" for _ in targets) + " | ---: |")
        for label, size, n in SIZES:
            # bodies[0] goes first and is not counted: it warms the router up, and for repeated
            # prompts it is the prefix seen once before.
            if mode == "unique":
                bodies = unique(size, n + 1)
            else:
                shared = prose(7 + size, size)
                bodies = [body(shared, q) for q in range(n + 1)]
            direct.post(bodies[0])
            base, _ = measure(direct, bodies[1:])
            cells = []
            for t in targets:
                t.post(bodies[0])
                p50, cpu = measure(t, bodies[1:])
                cells.append(f"{(p50 - base) * 1e3:.1f} ms, {cpu * 1e3:.1f} ms")
            print(f"| {label} | " + " | ".join(cells) + f" | {base * 1e3:.1f} ms |")

    lockstep = next((t for t in targets if t.name == "lockstep"), None)
    if lockstep is None:
        return
    # On model `short`, served by a mock pair of its own (see long_prompts.sh).
    short = [body("You are terse.", q).replace(b'"model": "smollm2"', b'"model": "short"', 1)
             for q in range(SHORTS)]
    assert all(b'"model": "short"' in b for b in short)
    p99 = lambda xs: xs[int(len(xs) * 0.99) - 1]
    # The control: the same long prompts sent to a second lockstep whose every thread runs at
    # idle priority (LONG_PROMPTS_CONTROL, started by long_prompts.sh), so the lockstep that serves
    # the short requests does no work for them. What the short requests lose then is the floor
    # this machine sets (the long prompts' clients, mocks and loopback copies on the same two
    # cores), not lockstep's doing.
    control = os.environ.get("LONG_PROMPTS_CONTROL")
    auth = lockstep.headers["authorization"][7:]
    # One sender of long prompts per destination, each from a process of its own (this one's GIL
    # would otherwise stall the short requests' client, not lockstep), their bodies made before
    # any short request is timed; each sends only while its `go` is set.
    loads = {"loaded": f"http://{lockstep.host}:{lockstep.port}"}
    if control:
        loads["control"] = control
    stop, senders = multiprocessing.Event(), {}
    for name, url in loads.items():
        ready, go = multiprocessing.Event(), multiprocessing.Event()
        busy, sent = multiprocessing.Value("i", 0), multiprocessing.Value("i", 0)
        proc = multiprocessing.Process(target=background, args=(
            f"bg={url}==" + auth, ready, go, stop, busy, sent))
        proc.start()
        ready.wait(120)
        senders[name] = (proc, go, busy, sent)
    # The conditions take turns in short blocks (the order rotating), so the machine's drift
    # over a minute (a p99 alone moved between 0.6 and 1.3 ms from one minute to the next on
    # this VM) falls on all of them alike; each p99 is over all its blocks.
    conds = ["alone", *loads]
    lat = {c: [] for c in conds}
    per = SHORTS // BLOCKS
    for blk in range(BLOCKS):
        for c in conds[blk % len(conds):] + conds[:blk % len(conds)]:
            if c != "alone":
                senders[c][1].set()
                time.sleep(0.05)
            lat[c] += [lockstep.post(b) for b in short[blk * per:(blk + 1) * per]]
            if c != "alone":
                _, go, busy, _ = senders[c]
                go.clear()
                for _ in range(2000):  # until its long prompt in flight is answered (<= 2 s)
                    if not busy.value:
                        break
                    time.sleep(0.001)
    stop.set()
    for proc, *_ in senders.values():
        proc.join(timeout=60)
    alone = p99(sorted(lat["alone"]))
    print(f"\nlockstep short requests ({per * BLOCKS} per condition, one at a time, in {BLOCKS} "
          f"blocks each, taking turns): p99 alone {alone * 1e3:.2f} ms")
    for c in loads:
        q = p99(sorted(lat[c]))
        what = ("to lockstep itself" if c == "loaded" else
                "to the idle-priority control lockstep instead (this machine's floor)")
        print(f"\n- while 128 KiB prompts go back to back {what} ({senders[c][3].value} of them): "
              f"p99 {q * 1e3:.2f} ms, {q / alone:.2f}x alone"
              + (" (target <= 1.20x)" if c == "loaded" else ""))

if __name__ == "__main__":
    main()
