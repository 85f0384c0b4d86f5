#!/usr/bin/env bash
# `lockstep serve` (config/default.toml, the embedded engine) against llama.cpp's own
# `llama-server` on the same GGUF, over HTTP, as a user would run each: llama-server built from the
# llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist with this CPU's flags (AMX off) and
# started with its defaults (`-m MODEL -t THREADS`); one server at a time, alternating, ROUNDS
# rounds (5 by default). Per round (bench/http_serving.py): single-stream greedy decode tokens/s,
# time to first token on ~512-token prompts that share no prefix (new in every round and server),
# and the throughput of 8 concurrent 64-token streams. Prints the medians with their spread and
# the ratios. Then single-stream decode again in PAIRS (12) pairs with both servers up
# (bench/paired_decode.py): the per-pair ratio is the figure the VM's slow phases move least.
# A benchmark, not a test: run it by hand.
#
#   bash bench/llama_server.sh            # THREADS=2 ROUNDS=5
#   BENCH_ISA=avx2 bash bench/llama_server.sh   # both kept to AVX2 (the EPYC kind's code)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
lockstep_isa_env
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-5}
MODEL=$(bash scripts/fetch-model.sh)
CACHE=${LLAMA_SERVER_CACHE:-$HOME/.cache/lockstep-bench}
ARGS=$(llama_cmake_args)
HASH=$(echo "$ARGS" | sha256sum | cut -c1-12)
LLS="$CACHE/llama-server-$HASH/llama-server"
if [ ! -x "$LLS" ]; then
  echo "building llama-server from the llama-cpp-python 0.3.36 sdist (about 10 minutes): $ARGS" >&2
  python3 -m pip install --quiet cmake ninja
  SRC=$(mktemp -d)
  # The sdist itself (pip would build it): its address from PyPI's simple index.
  URL=$(curl -sf https://pypi.org/simple/llama-cpp-python/ \
        | grep -o 'https://[^"#]*llama_cpp_python-0.3.36.tar.gz' | head -1)
  curl -sfL "$URL" | tar xz -C "$SRC"
  # shellcheck disable=SC2086 # the flags are words
  cmake -S "$SRC/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$SRC/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF $ARGS >/dev/null
  cmake --build "$SRC/build" --target llama-server -j "$(nproc)" >/dev/null
  mkdir -p "$(dirname "$LLS")"
  cp "$SRC/build/bin/llama-server" "$LLS"
  rm -rf "$SRC"
fi
cargo build --release --quiet -p lockstep --bin lockstep

start_workdir
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# start WHO PORT LOG: starts WHO on PORT (its pid last in PIDS) and waits until it is ready
# (lockstep's `/ready`, llama-server's `/health`, 503 while the model loads).
start() {
  local who=$1 port=$2 ready=/health
  if [ "$who" = lockstep ]; then
    RAYON_NUM_THREADS=$THREADS target/release/lockstep serve --http-listen "127.0.0.1:$port" \
      --log-level warn >"$3" 2>&1 &
    ready=/ready
  else
    "$LLS" -m "$MODEL" -t "$THREADS" --host 127.0.0.1 --port "$port" >"$3" 2>&1 &
  fi
  PIDS+=("$!")
  for _ in $(seq 1 600); do
    curl -sf -m 1 "http://127.0.0.1:$port$ready" >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "$who never became ready; log:"; tail -n 20 "$3"; exit 1
}
# run_one WHO ROUND: starts WHO, measures, stops it (by pid).
run_one() {
  local who=$1 round=$2 port pid
  port=$(free_port)
  start "$who" "$port" "$WORK/$who.log"
  pid=${PIDS[-1]}
  python3 bench/http_serving.py "http://127.0.0.1:$port" "$who" "$round" >>"$WORK/results.jsonl" \
    || { echo "$who failed; log:"; tail -n 20 "$WORK/$who.log"; exit 1; }
  kill "$pid"
  wait "$pid" 2>/dev/null || true
}
for r in $(seq 1 "$ROUNDS"); do
  run_one lockstep "$r"
  run_one llama-server "$r"
done
# Single-stream decode again, in pairs with both servers up (bench/paired_decode.py): the VM's
# slow phases last seconds, so streams seconds apart compare the programs, not the phases.
PAIRS=${PAIRS:-12}
PA=$(free_port) PB=$(free_port)
start lockstep "$PA" "$WORK/paired-lockstep.log"
start llama-server "$PB" "$WORK/paired-llama.log"
PAIRED=$(python3 bench/paired_decode.py "http://127.0.0.1:$PA" lockstep "http://127.0.0.1:$PB" llama-server "$PAIRS")
python3 - "$WORK/results.jsonl" "$THREADS" "$ARGS" "$PAIRED" <<'PY'
import json, os, statistics, sys, platform
rows = [json.loads(l) for l in open(sys.argv[1])]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"SmolLM2-135M-Instruct Q4_1, {sys.argv[2]} threads, {cpu}, {len(rows) // 2} alternating rounds")
print(f"instruction sets: {os.environ.get('BENCH_ISA', 'native')} (lockstep kernels: {os.environ.get('LOCKSTEP_CPU_KERNELS', 'the best the CPU has')})")
print(f"llama-server: llama-cpp-python 0.3.36's llama.cpp, {sys.argv[3]}")
print("| measure | lockstep serve | llama-server | ratio |")
print("| --- | ---: | ---: | ---: |")
for key, label, better in [("decode_tok_s", "single-stream decode, tok/s", "higher"),
                           ("ttft_ms", "time to first token, ~512 unshared tokens, ms", "lower"),
                           ("conc8_tok_s", "8 concurrent 64-token streams, tok/s", "higher")]:
    def cell(who):
        v = [r[key] for r in rows if r["who"] == who]
        return statistics.median(v), min(v), max(v)
    (a, alo, ahi), (b, blo, bhi) = cell("lockstep"), cell("llama-server")
    print(f"| {label} | {a:.1f} ({alo:.1f}–{ahi:.1f}) | {b:.1f} ({blo:.1f}–{bhi:.1f}) | {a / b:.2f}x |")
p = json.loads(sys.argv[4])
print(f"| single-stream decode, {p['pairs']} paired streams, tok/s | {p['lockstep']:.1f} | {p['llama-server']:.1f} "
      f"| {p['ratio_median']:.2f}x ({p['ratio_min']:.2f}–{p['ratio_max']:.2f}) per pair |")
PY
