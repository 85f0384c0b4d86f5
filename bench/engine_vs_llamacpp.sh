#!/usr/bin/env bash
# The embedded engine against llama.cpp (llama-cpp-python 0.3.36) on the same GGUF, on this
# machine, with the same thread count, alternating ROUNDS rounds (5 by default, one process at a
# time): prefill tokens/s on a 512-token prompt, decode tokens/s at batch 1 and batch 8 (llama.cpp
# in the context a user would give each case: one sequence for prefill and batch 1, eight for
# batch 8); then lockstep end to end through HTTP. Prints medians with their spread and the
# ratios. A benchmark, not a test: run it by hand.
#
#   bash bench/engine_vs_llamacpp.sh            # THREADS=2 ROUNDS=5
#   BENCH_ISA=avx2 bash bench/engine_vs_llamacpp.sh   # both kept to AVX2 (the EPYC kind's code)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
MODEL=$(bash scripts/fetch-model.sh)
# llama.cpp built for this CPU with explicit flags (AMX off: `llama_cmake_args`, bench/lib.sh).
. bench/lib.sh
lockstep_isa_env
VENV=${LLAMA_VENV:-$HOME/.cache/lockstep-bench/venv-llama$([ "${BENCH_ISA:-native}" = native ] || echo "-$BENCH_ISA")}
CMAKE_ARGS=$(llama_cmake_args)
export CMAKE_ARGS
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
   || [ "$(cat "$VENV/lockstep-cmake-args" 2>/dev/null)" != "$CMAKE_ARGS" ]; then
  echo "building llama-cpp-python 0.3.36 from source into $VENV (about 10 minutes): $CMAKE_ARGS" >&2
  python3 -m venv "$VENV"
  # --no-cache-dir: pip would otherwise reuse a wheel built with other flags.
  "$VENV/bin/pip" install --quiet --no-cache-dir --force-reinstall llama-cpp-python==0.3.36 numpy
  echo "$CMAKE_ARGS" > "$VENV/lockstep-cmake-args"
fi
cargo build --release --quiet -p lockstep-engine --example bench_model
cargo build --release --quiet -p lockstep --bin lockstep
# `lockstep serve` runs throughout (idle while the engines are measured), for the serving path's
# figures in every round, beside the engine's own.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
RAYON_NUM_THREADS=$THREADS target/release/lockstep serve --http-listen "127.0.0.1:$PORT" --log-level warn &
PID=$!
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=1)" 2>/dev/null && break
  sleep 0.2
done
# ROUNDS alternating rounds (5 by default), one measurement at a time: one run on these VMs is
# noise. Each round: lockstep's engine, llama.cpp, then lockstep over HTTP (its own prompt words
# per round: no prefix cache serves its time to first token).
ROUNDS=${ROUNDS:-5}
# Each round also times batch 1 at the positions a short HTTP stream decodes at (256 steps after
# a 4-token prompt, one repetition each, the two engines back to back in alternating order):
# the per-round ratio of these pairs is printed beside the medians.
OURS="" THEIRS="" E2E="" SHORT=""
short() {
  if [ "$1" = lockstep ]; then
    BENCH_ONLY_B1=1 BENCH_CONTEXT=4 BENCH_STEPS=256 BENCH_REPS=1 RAYON_NUM_THREADS=$THREADS \
      target/release/examples/bench_model "$MODEL"
  else
    BENCH_CONTEXT=4 BENCH_STEPS=256 BENCH_REPS=1 "$VENV/bin/python" bench/llamacpp_engine.py \
      "$MODEL" "$THREADS" 2>/dev/null
  fi | python3 -c 'import json, sys; print(json.load(sys.stdin)["decode_b1_tok_s"])'
}
for r in $(seq 1 "$ROUNDS"); do
  OURS="$OURS$(RAYON_NUM_THREADS=$THREADS target/release/examples/bench_model "$MODEL")"$'\n'
  THEIRS="$THEIRS$("$VENV/bin/python" bench/llamacpp_engine.py "$MODEL" "$THREADS" 2>/dev/null)"$'\n'
  E2E="$E2E$(python3 bench/e2e_http.py "http://127.0.0.1:$PORT" SmolLM2-135M-Instruct "$r")"$'\n'
  if [ $((r % 2)) = 1 ]; then a=$(short lockstep); b=$(short llama); else b=$(short llama); a=$(short lockstep); fi
  SHORT="$SHORT$a $b"$'\n'
done
export SHORT

python3 - "$OURS" "$THEIRS" "$E2E" "$THREADS" <<'PY'
import json, os, statistics, sys
rows = lambda t: [json.loads(l) for l in t.splitlines() if l.strip()]
ours, theirs, e2e, threads = rows(sys.argv[1]), rows(sys.argv[2]), rows(sys.argv[3]), sys.argv[4]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"CPU: {cpu}; instruction sets: {os.environ.get('BENCH_ISA', 'native')}")
print(f"SmolLM2-135M-Instruct Q4_1, {threads} threads, {theirs[0].get('llama_cpp_python', '?')} llama-cpp-python, {len(ours)} alternating rounds")
print(f"llama.cpp build: {os.environ.get('CMAKE_ARGS', '?')}")
print(f"lockstep kernels (chosen at run time): {ours[0].get('kernels', '?')}")
print("llama.cpp contexts: prefill and batch 1 in a single-sequence context, batch 8 in an eight-sequence one")
print(f"{'measure':<28}{'lockstep (min-max)':>26}{'llama.cpp (min-max)':>26}{'ratio':>8}")
for k, name in [("prefill512_tok_s", "prefill 512 tokens, tok/s"), ("decode_b1_tok_s", "decode batch 1, tok/s"),
                ("decode_b8_tok_s", "decode batch 8, tok/s")]:
    a, b = [r[k] for r in ours], [r[k] for r in theirs]
    ma, mb = statistics.median(a), statistics.median(b)
    cell = lambda m, v: f"{m:.1f} ({min(v):.1f}-{max(v):.1f})"
    print(f"{name:<28}{cell(ma, a):>26}{cell(mb, b):>26}{ma / mb:>7.2f}x")
cell = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
pairs = [tuple(map(float, l.split())) for l in os.environ["SHORT"].splitlines() if l.strip()]
sa, sb = [a for a, _ in pairs], [b for _, b in pairs]
print(f"{'decode batch 1, pos 4-260':<28}{statistics.median(sa):>12.1f} ({min(sa):.1f}-{max(sa):.1f})"
      f"{statistics.median(sb):>13.1f} ({min(sb):.1f}-{max(sb):.1f})"
      f"   per pair {cell([a / b for a, b in pairs])}x")
print("lockstep end to end (HTTP, split prefill/decode engines), medians (min-max):")
for k in ["ttft_512_s", "decode_b1_tok_s", "decode_after512_tok_s", "concurrent8_tok_s"]:
    print(f"  {k:<24}{cell([r[k] for r in e2e]):>26}")
# The serving path against the engine's own figures, round by round (issue 42: >= 95% decode,
# <= 1.1x TTFT): each HTTP figure over the engine's in the same round.
dec = [h["decode_after512_tok_s"] / o["decode_b1_tok_s"] for h, o in zip(e2e, ours)]
tt = [h["ttft_512_s"] / (h["prompt_tokens"] / o["prefill512_tok_s"]) for h, o in zip(e2e, ours)]
print(f"serving path, per round: HTTP decode after 512 tokens / the engine's batch 1 = {cell(dec)}; "
      f"time to first token / the engine's prefill time = {cell(tt)}")
PY
