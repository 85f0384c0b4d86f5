#!/usr/bin/env bash
# Long prompts through the routers, one run, side by side (see README "Long prompts"): chat
# requests whose system prompt is 16 KiB, 128 KiB or 1 MiB of text, sent one at a time to
# lockstep (SGLang PD mode, SmolLM2's real tokenizer and chat template, configured for them: a
# context and KV capacity of 1 Mi tokens, a 16 MiB body limit, one tenant so its segment cache
# applies), smg 1.13.0 (`smg launch --pd-disaggregation`) and vllm-router 0.1.17
# (`--vllm-pd-disaggregation`), each in front of its own pair of upstream mocks
# (bench/long_prompt_mock.py: one token, the prompt count it was sent). Prints each router's
# added latency and CPU per request, unique and repeated prompts, and lockstep's short-request
# p99 while long prompts arrive (and, as a control, while they go to a second, idle-priority
# lockstep instead: the floor this machine sets). Every process started here is stopped by pid
# on exit.
# Usage: bash bench/long_prompts.sh   (installs the peers into ~/.cache/lockstep-bench)
# LONG_PROMPTS_ONLY_LOADED=1: only the short-request p99 part. LONG_PROMPTS_BUSY_POLL_US=N: lockstep
# with `server.busy_poll_us = N` (default 0, off).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
CACHE=${LOCKSTEP_BENCH_CACHE:-$HOME/.cache/lockstep-bench}
mkdir -p "$CACHE"
for p in smg==1.13.0 vllm-router==0.1.17; do
  d="$CACHE/venv-${p%%==*}"
  [ -x "$d/bin/${p%%==*}" ] || { python3 -m venv "$d" && "$d/bin/pip" install -q "$p"; }
done
MODEL=$(bash scripts/fetch-model.sh)
cargo build --release -q -p lockstep
cargo build --release -q -p lockstep-engine --example export_tokenizer

start_workdir
mkdir -p "$WORK/logs"
target/release/examples/export_tokenizer "$MODEL" "$WORK"
# The workers of a real deployment run elsewhere (on GPUs), not on the router's cores: the mocks
# that take the long prompts run only on time the routers leave idle (SCHED_IDLE; nice +10 where
# that is refused), so their work does not pass for the router's cost in the loaded
# short-request measurement. On an idle machine (the latency tables) it changes nothing.
if chrt --idle 0 true 2>/dev/null; then IDLE=(chrt --idle 0); else IDLE=(nice -n 10); fi
mock() { "${IDLE[@]}" python3 bench/long_prompt_mock.py "$1" "$2" "$3" >"$WORK/logs/mock-$3.log" 2>&1 & PIDS+=($!); }
mock sglang prefill 23001; mock sglang decode 23002   # lockstep's pair
mock sglang prefill 23003; mock sglang decode 23004   # smg's pair
mock vllm prefill 23005; mock vllm decode 23006       # vllm-router's pair
# lockstep's short requests go to a pair of their own at normal priority (model `short`): one
# mock process busy with a long prompt would hold its GIL, and the short request would wait on
# the mock, not on lockstep.
python3 bench/long_prompt_mock.py sglang prefill 23007 >"$WORK/logs/mock-23007.log" 2>&1 & PIDS+=($!)
python3 bench/long_prompt_mock.py sglang decode 23008 >"$WORK/logs/mock-23008.log" 2>&1 & PIDS+=($!)
# The gateways check their workers once at start and back off: the mocks answer first.
for port in 23001 23002 23003 23004 23005 23006 23007 23008; do
  for _ in $(seq 1 100); do curl -sf -m 1 "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
done

"$CACHE/venv-smg/bin/smg" launch --pd-disaggregation --prefill http://127.0.0.1:23003 8998 \
  --decode http://127.0.0.1:23004 --host 127.0.0.1 --port 23021 --prometheus-port 23121 \
  --max-payload-size 16777216 --log-level error >"$WORK/logs/smg.log" 2>&1 &
SMG=$!; PIDS+=($SMG)
"$CACHE/venv-vllm-router/bin/vllm-router" --vllm-pd-disaggregation --prefill http://127.0.0.1:23005 \
  --decode http://127.0.0.1:23006 --kv-connector nixl --host 127.0.0.1 --port 23022 \
  --prometheus-port 23122 --max-payload-size 16777216 --log-level error >"$WORK/logs/vllm-router.log" 2>&1 &
VR=$!; PIDS+=($VR)
KEY_SHA256=$(printf %s bench-key | sha256sum | cut -d' ' -f1)
{
cat <<TOML
[server]
http_listen = "127.0.0.1:23030"
log_level = "warn"
max_body_bytes = 16777216
busy_poll_us = ${LONG_PROMPTS_BUSY_POLL_US:-0}

[[tenants]]
name = "bench"
api_keys_sha256 = ["$KEY_SHA256"]  # "bench-key"
models = ["*"]
TOML
model_toml smollm2 23001 23002
model_toml short 23007 23008
} > "$WORK/lockstep.toml"
target/release/lockstep serve --config "$WORK/lockstep.toml" >"$WORK/logs/lockstep.log" 2>&1 &
LS=$!; PIDS+=($LS)

# The control for the short-request p99: the same lockstep again, every thread at idle
# priority, taking the long prompts in the control blocks (see bench/long_prompts.py).
sed "s/127.0.0.1:23030/127.0.0.1:23031/" "$WORK/lockstep.toml" > "$WORK/control.toml"
"${IDLE[@]}" target/release/lockstep serve --config "$WORK/control.toml" >"$WORK/logs/control.log" 2>&1 &
PIDS+=($!)

SHORT='{"model":"smollm2","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
for port in 23021 23022; do wait_answers /v1/chat/completions "$SHORT" choices "x:$port"; done
for port in 23030 23031; do
  for _ in $(seq 1 150); do
    curl -sf -m 2 -H 'authorization: Bearer bench-key' -H 'content-type: application/json' -d "$SHORT" \
      http://127.0.0.1:$port/v1/chat/completions | grep -q choices && break
    sleep 0.2
  done
done
LONG_PROMPTS_CONTROL=http://127.0.0.1:23031 python3 bench/long_prompts.py http://127.0.0.1:23004 \
  "smg-1.13.0=http://127.0.0.1:23021=$SMG" "vllm-router-0.1.17=http://127.0.0.1:23022=$VR" \
  "lockstep=http://127.0.0.1:23030=$LS=bench-key"
