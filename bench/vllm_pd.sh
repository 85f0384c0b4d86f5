#!/usr/bin/env bash
# vLLM PD routing, one run, side by side: direct to the decode mock; nginx as a plain proxy
# (floor); vllm-router 0.1.17 from PyPI (--vllm-pd-disaggregation --kv-connector nixl); lockstep
# (backend = "vllm"). Upstreams are nginx answering fixed vLLM /v1/completions payloads: the
# prefill a JSON answer with kv_transfer_params (2 prompt tokens, one block); the decode an SSE
# stream ("stream" mode) or, in "json" mode, JSON or SSE as the request's "stream" field asks (one
# internal nginx hop reads the body; lockstep always asks the decode for a stream, with running
# usage: its barrier checks the first chunk). wrk on loopback, concurrency 1 and 32. Every
# process started here is stopped by pid on exit.
# Usage: bash bench/vllm_pd.sh [seconds-per-run]   (needs wrk, nginx, curl, python3; installs
# vllm-router into ~/.cache/lockstep-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
DUR=${1:-8}
CACHE=${LOCKSTEP_BENCH_CACHE:-$HOME/.cache/lockstep-bench}
mkdir -p "$CACHE"
for tool in wrk nginx curl; do command -v $tool >/dev/null || { echo "install $tool (apt-get install wrk nginx curl)"; exit 1; }; done
VR="$CACHE/venv-vllm-router"
[ -x "$VR/bin/vllm-router" ] || { python3 -m venv "$VR" && "$VR/bin/pip" install -q vllm-router==0.1.17; }
cargo build --release -q -p lockstep

start_workdir

USAGE='"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}'
PREFILL='{"id":"c","object":"text_completion","model":"mock-pd","choices":[{"index":0,"text":"x","logprobs":null,"finish_reason":"length"}],'$USAGE',"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0],"remote_engine_id":"e","remote_host":"127.0.0.1","remote_port":5600,"remote_request_id":"cmpl-$http_x_request_id-0-0","tp_size":1}}'
DECODE_JSON='{"id":"c","object":"text_completion","model":"mock-pd","choices":[{"index":0,"text":"hello","logprobs":null,"finish_reason":"length"}],'$USAGE'}'
DECODE_SSE=$(printf 'data: %s\n\ndata: [DONE]\n\n' "$DECODE_JSON")
mkdir -p "$WORK/logs"
cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $WORK/body;
  proxy_temp_path $WORK/proxy;
  upstream decode_sse { server 127.0.0.1:32004; keepalive 64; }
  upstream decode_mixed { server 127.0.0.1:32002; keepalive 64; }
  upstream decode_answers { server 127.0.0.1:32003; keepalive 64; }
  map \$request_body \$want_stream { "~\"stream\": *true" 1; default 0; }
  server { listen 127.0.0.1:32001;
    location /v1/completions { default_type application/json; return 200 '$PREFILL'; }
    location / { default_type application/json; return 200 '{}'; } }
  server { listen 127.0.0.1:32002;
    location /v1/completions { proxy_pass http://decode_answers; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header X-Stream \$want_stream; proxy_buffering off; }
    location / { default_type application/json; return 200 '{}'; } }
  server { listen 127.0.0.1:32003;
    location /v1/completions { if (\$http_x_stream = 1) { rewrite ^ /sse last; } default_type application/json; return 200 '$DECODE_JSON'; }
    location /sse { default_type text/event-stream; return 200 '$DECODE_SSE'; } }
  server { listen 127.0.0.1:32004;
    location /v1/completions { default_type text/event-stream; return 200 '$DECODE_SSE'; }
    location / { default_type application/json; return 200 '{}'; } }
  server { listen 127.0.0.1:32010; location / { proxy_pass http://decode_mixed; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
  server { listen 127.0.0.1:32011; location / { proxy_pass http://decode_sse; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
}
NGINX
nginx -p "$WORK" -c "$WORK/nginx.conf" & PIDS+=($!)

router() { # port decode-port prometheus-port
  "$VR/bin/vllm-router" --vllm-pd-disaggregation --prefill http://127.0.0.1:32001 --decode "http://127.0.0.1:$2" \
    --kv-connector nixl --host 127.0.0.1 --port "$1" --prometheus-port "$3" --log-level error >"$WORK/logs/vllm-router-$1.log" 2>&1 &
  PIDS+=($!)
}
router 32020 32002 32120
router 32022 32004 32122
target/release/lockstep serve --config bench/vllm-bench.toml >"$WORK/logs/lockstep-json.log" 2>&1 & PIDS+=($!)
sed -e 's/32030/32031/; s/32002/32004/' bench/vllm-bench.toml > "$WORK/vllm-bench-stream.toml"
sed -i "s|\.\./config/|$PWD/config/|" "$WORK/vllm-bench-stream.toml"
target/release/lockstep serve --config "$WORK/vllm-bench-stream.toml" >"$WORK/logs/lockstep-stream.log" 2>&1 & PIDS+=($!)

BODY_stream='{"model":"mock-pd","prompt":"hello world","max_tokens":1,"stream":true}'
BODY_json='{"model":"mock-pd","prompt":"hello world","max_tokens":1,"stream":false}'
for mode in stream json; do
  body_var=BODY_$mode
  printf 'wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n' "'${!body_var}'" > "$WORK/post_$mode.lua"
done
TARGETS_json="direct:32002 nginx-proxy:32010 vllm-router-0.1.17:32020 lockstep:32030"
TARGETS_stream="direct:32004 nginx-proxy:32011 vllm-router-0.1.17:32022 lockstep:32031"

for mode in json stream; do
  body_var=BODY_$mode; targets_var=TARGETS_$mode
  wait_answers /v1/completions "${!body_var}" hello "${!targets_var}"
done

run() { wrk_run "$1" "$2" "$3" /v1/completions; }

declare -A R
for mode in stream json; do
  [ $mode = json ] && echo "### json mode: the client asks for a JSON answer (stream=false)" || echo "### stream mode: the client asks for a stream (stream=true)"
  echo
  echo "| target | c=1 req/s | c=1 p50 | c=1 p99 | c=32 req/s | c=32 p50 | c=32 p99 | non-2xx |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  targets_var=TARGETS_$mode
  for t in ${!targets_var}; do
    name=${t%%:*}; port=${t##*:}
    read -r r1 a1 b1 e1 < <(run "$port" 1 $mode)
    read -r r32 a32 b32 e32 < <(run "$port" 32 $mode)
    R[$mode.$name.r1]=$r1; R[$mode.$name.r32]=$r32
    echo "| $name | $r1 | $a1 | $b1 | $r32 | $a32 | $b32 | $((e1 + e32)) |"
  done
  echo
  awk -v l1="${R[$mode.lockstep.r1]}" -v v1="${R[$mode.vllm-router-0.1.17.r1]}" -v l="${R[$mode.lockstep.r32]}" -v v="${R[$mode.vllm-router-0.1.17.r32]}" 'BEGIN{
    printf "- lockstep / vllm-router throughput: c=1 %.2fx, c=32 %.2fx (target >= 2x)\n", l1/v1, l/v }'
  echo
done
