#!/usr/bin/env bash
# A/B of two lockstep binaries on unique long chat prompts (see README "Long prompts"): each in
# turn, round by round, in front of the same pair of bench/long_prompt_mock.py SGLang mocks, with
# SmolLM2's real tokenizer and template and the long-prompt bench's configuration (context and
# KV capacity of 1 Mi tokens, a 16 MiB body limit, one tenant). Every prompt is new (a seed per
# round and binary). Prints one line per run (round, binary, p50, lockstep's CPU per request) and
# the medians per binary. Every process started here is stopped by pid on exit.
# Usage: bash bench/ab_long_prompts.sh A_BINARY B_BINARY [rounds] [requests] [bytes]
#   (defaults: 3 rounds, 150 requests of 128 KiB each per run)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 1; }
A=$(realpath "$1"); B=$(realpath "$2"); ROUNDS=${3:-3}; N=${4:-150}; SIZE=${5:-131072}
MODEL=$(bash scripts/fetch-model.sh)
cargo build --release -q -p lockstep-engine --example export_tokenizer

start_workdir
mkdir -p "$WORK/logs"
target/release/examples/export_tokenizer "$MODEL" "$WORK" >/dev/null
python3 bench/long_prompt_mock.py sglang prefill 25001 >"$WORK/logs/mock-prefill.log" 2>&1 & PIDS+=($!)
python3 bench/long_prompt_mock.py sglang decode 25002 >"$WORK/logs/mock-decode.log" 2>&1 & PIDS+=($!)
for port in 25001 25002; do
  for _ in $(seq 1 100); do curl -sf -m 1 "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
done
KEY_SHA256=$(printf %s bench-key | sha256sum | cut -d' ' -f1)
{
cat <<TOML
[server]
http_listen = "127.0.0.1:25030"
log_level = "warn"
max_body_bytes = 16777216

[[tenants]]
name = "bench"
api_keys_sha256 = ["$KEY_SHA256"]  # "bench-key"
models = ["*"]
TOML
model_toml smollm2 25001 25002
} > "$WORK/lockstep.toml"

SHORT='{"model":"smollm2","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
seed=1
for round in $(seq 1 "$ROUNDS"); do
  for name in A B; do
    bin=$A; [ $name = B ] && bin=$B
    "$bin" serve --config "$WORK/lockstep.toml" >"$WORK/logs/lockstep-$name-$round.log" 2>&1 &
    LS=$!; PIDS+=($LS)
    for _ in $(seq 1 150); do
      curl -sf -m 2 -H 'authorization: Bearer bench-key' -H 'content-type: application/json' \
        -d "$SHORT" http://127.0.0.1:25030/v1/chat/completions | grep -q choices && break
      sleep 0.2
    done
    line=$(cd bench && python3 ab_long_prompts.py http://127.0.0.1:25030 "$LS" "$SIZE" "$N" "$seed")
    seed=$((seed + 1))
    echo "round $round $name: $line" | tee -a "$WORK/runs.txt"
    kill "$LS"; wait "$LS" 2>/dev/null || true
  done
done
python3 - "$WORK/runs.txt" <<'PY'
import statistics, sys
runs = [line.split() for line in open(sys.argv[1])]
for name in ("A", "B"):
    mine = [r for r in runs if r[2] == name + ":"]
    p50 = statistics.median(float(r[4]) for r in mine)
    cpu = statistics.median(float(r[7]) for r in mine)
    print(f"median {name}: p50 {p50:.2f} ms, CPU {cpu:.2f} ms/req ({len(mine)} runs)")
PY
