"""Client of bench/ab_long_prompts.sh: N unique long chat prompts (bench/long_prompts.py's text),
one at a time on a keep-alive connection, to one lockstep, after a warm-up of unique prompts that
is not measured. Prints one line: the median latency and the CPU time per request of the
lockstep process (user + system, from /proc).

    python3 ab_long_prompts.py URL PID BYTES REQUESTS SEED
"""
import statistics
import sys

from long_prompts import Target, body, prose

WARMUP = 200  # unique prompts before anything is measured (the allocator's heap grows to them)


def main():
    url, pid, size, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    t = Target(f"lockstep={url}={pid}=bench-key")
    for i in range(WARMUP):
        t.post(body(prose(seed * 1000 + i, size), i))
    bodies = [body(prose(seed * 1000 + WARMUP + i, size), i) for i in range(n)]
    c0 = t.cpu()
    lat = [t.post(b) for b in bodies]
    cpu = (t.cpu() - c0) / n
    print(f"p50 {statistics.median(lat) * 1e3:.2f} ms, CPU {cpu * 1e3:.2f} ms/req")


main()
