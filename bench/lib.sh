# Shared by the benchmarks (bench/pd_proxy.sh, bench/vllm_pd.sh, the long-prompt benches); sourced, never run.
# The wrk helpers expect WORK (with post_<mode>.lua scripts) and DUR to be set.

# start_workdir: a fresh $WORK and the PIDS array; on exit every pid in PIDS is stopped (by pid,
# never by name) and $WORK removed.
start_workdir() {
  WORK=$(mktemp -d)
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
}

# wait_answers PATH BODY NEEDLE TARGETS: waits (bounded) until every name:port target answers
# POST PATH with BODY and a body containing NEEDLE; exits with their logs if one never does.
wait_answers() {
  local path=$1 body=$2 needle=$3 t port ok
  for t in $4; do
    port=${t##*:}; ok=""
    for _ in $(seq 1 150); do
      if curl -sf -m 2 -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$port$path" 2>/dev/null | grep -q "$needle"; then ok=1; break; fi
      sleep 0.2
    done
    [ -n "$ok" ] || { echo "$t never answered; logs:"; tail -n 20 "$WORK"/logs/*; exit 1; }
  done
}

# tree_cpu PID: CPU time (user + system, clock ticks) of PID and every process below it.
tree_cpu() {
  local t=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null); do
    if [ "$p" = "$1" ]; then
      t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
    else
      t=$((t + $(tree_cpu "$p")))
    fi
  done
  echo $t
}

# wrk_run PORT CONCURRENCY MODE PATH -> "rps p50 p99 non-2xx"
wrk_run() {
  local out rps p50 p99 bad
  out=$(wrk -t$([ "$2" = 1 ] && echo 1 || echo 2) -c"$2" -d"${DUR}s" --latency -s "$WORK/post_$3.lua" "http://127.0.0.1:$1$4")
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  bad=$(awk '/Non-2xx/ {print $NF}' <<<"$out"); bad=${bad:-0}
  echo "$rps $p50 $p99 $bad"
}

# write_pd_upstreams: writes $WORK/nginx.conf, nginx answering fixed SGLang /generate payloads:
# the prefill on :31001; the decode in json mode on :31002 (JSON or SSE as the body asks, through
# one internal hop on :31003) and in stream mode on :31004; nginx as a plain proxy in front of each
# decode on :31010 (json) and :31011 (stream). Creates $WORK/logs.
write_pd_upstreams() {
  # The prefill's fixed answer names no `meta_info.id`: lockstep checks an id against the pair's
  # rid where one is present, and a fixed payload cannot echo it.
  local PREFILL DECODE_JSON DECODE_SSE INFO_PREFILL INFO_DECODE ARGS
  PREFILL='{"text":"x","output_ids":[1],"meta_info":{"prompt_tokens":2,"completion_tokens":1,"cached_tokens":0,"finish_reason":{"type":"length","length":1}}}'
  DECODE_JSON='{"text":"hello","output_ids":[1],"meta_info":{"id":"r","prompt_tokens":2,"completion_tokens":1,"cached_tokens":0,"finish_reason":{"type":"length","length":1}}}'
  DECODE_SSE=$(printf 'data: %s\n\ndata: [DONE]\n\n' "$DECODE_JSON")
  # /server_info as SGLang 0.5.23 answers it (the keys lockstep's deployment check reads)
  ARGS='"disaggregation_transfer_backend":"mooncake","disaggregation_bootstrap_port":8998,"disaggregation_enable_kv_checksum":true,"incremental_streaming_output":false,"skip_tokenizer_init":false,"page_size":1,"kv_cache_dtype":"auto","tp_size":1,"pp_size":1,"model_path":"mock","tokenizer_path":"mock","is_generation":true,"max_total_num_tokens":1000000,"max_req_input_len":999994'
  INFO_PREFILL='{"disaggregation_mode":"prefill",'$ARGS'}'
  INFO_DECODE='{"disaggregation_mode":"decode",'$ARGS'}'
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
  upstream decode_sse { server 127.0.0.1:31004; keepalive 64; }
  upstream decode_mixed { server 127.0.0.1:31002; keepalive 64; }
  upstream decode_answers { server 127.0.0.1:31003; keepalive 64; }
  map \$request_body \$want_stream { "~\"stream\": *true" 1; default 0; }
  # prefill
  server { listen 127.0.0.1:31001;
    location /generate { default_type application/json; return 200 '$PREFILL'; }
    location / { default_type application/json; return 200 '$INFO_PREFILL'; } }
  # decode, json mode: SSE or JSON as the body asks (one internal hop reads the body)
  server { listen 127.0.0.1:31002;
    location /generate { proxy_pass http://decode_answers; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header X-Stream \$want_stream; proxy_buffering off; }
    location / { default_type application/json; return 200 '$INFO_DECODE'; } }
  server { listen 127.0.0.1:31003;
    location /generate { if (\$http_x_stream = 1) { rewrite ^ /sse last; } default_type application/json; return 200 '$DECODE_JSON'; }
    location /sse { default_type text/event-stream; return 200 '$DECODE_SSE'; } }
  # decode, stream mode: SSE to every request
  server { listen 127.0.0.1:31004;
    location /generate { default_type text/event-stream; return 200 '$DECODE_SSE'; }
    location / { default_type application/json; return 200 '$INFO_DECODE'; } }
  # nginx as a plain single-upstream proxy in front of each decode
  server { listen 127.0.0.1:31010; location / { proxy_pass http://decode_mixed; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
  server { listen 127.0.0.1:31011; location / { proxy_pass http://decode_sse; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
}
NGINX
}

# write_pd_bodies: sets BODY_stream and BODY_json (SGLang /generate, one new token) and writes
# $WORK/post_stream.lua and $WORK/post_json.lua for wrk.
write_pd_bodies() {
  BODY_stream='{"text":"hello world","stream":true,"sampling_params":{"max_new_tokens":1}}'
  BODY_json='{"text":"hello world","stream":false,"sampling_params":{"max_new_tokens":1}}'
  for mode in stream json; do
    body_var=BODY_$mode
    printf 'wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n' "'${!body_var}'" > "$WORK/post_$mode.lua"
  done
}

# model_toml NAME PREFILL_PORT DECODE_PORT: one [[models]] section for the long-prompt benches
# (SGLang PD, SmolLM2's tokenizer and template exported into $WORK, a context and KV capacity of
# 1 Mi tokens, one token per answer, no retries).
model_toml() {
  cat <<TOML

[[models]]
name = "$1"
backend = "sglang"
context_window = 1048576
kv_capacity_tokens = 1048576
default_max_tokens = 1
tokenizer = "$WORK/tokenizer.json"
chat_template = { path = "$WORK/chat_template.jinja" }

[models.prefill]
workers = [{ url = "http://127.0.0.1:$2", bootstrap_port = 8998 }]

[models.decode]
workers = [{ url = "http://127.0.0.1:$3" }]

[models.retry]
max_retries = 0

[models.health]
interval_ms = 10000
TOML
}

# llama_cmake_args: llama.cpp's CMake flags for this CPU, explicit: every SIMD extension the CPU
# reports, AMX always off (these VMs report AMX, but AMX tile use segfaults, so GGML_NATIVE=ON
# crashes). BENCH_ISA=avx2 keeps to what an AVX2-only CPU (the AMD EPYC kind these machines also
# come as) has: no AVX-512, no AVX-VNNI (pair it with `lockstep_isa_env`).
llama_cmake_args() {
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  on() {
    case "${BENCH_ISA:-native}:$1" in avx2:avx512* | avx2:avx_vnni) echo OFF; return ;; esac
    case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac
  }
  echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) \
-DGGML_F16C=$(on f16c) -DGGML_AVX512=$(on avx512f) -DGGML_AVX512_VNNI=$(on avx512_vnni) \
-DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AVX_VNNI=$(on avx_vnni) \
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"
}

# lockstep_isa_env: exports LOCKSTEP_CPU_KERNELS=avx2 when BENCH_ISA=avx2, so lockstep keeps to
# the same instruction set as the llama.cpp built by `llama_cmake_args`.
lockstep_isa_env() {
  case "${BENCH_ISA:-native}" in
    native) ;;
    avx2) export LOCKSTEP_CPU_KERNELS=avx2 ;;
    *) echo "BENCH_ISA must be native or avx2, not ${BENCH_ISA}" >&2; exit 2 ;;
  esac
}
