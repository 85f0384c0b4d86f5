#!/usr/bin/env bash
# Router overhead benchmark, one run, side by side (see README "Benchmarks"):
#   direct to the decode mock; nginx as a plain proxy (floor); SGLang's gateway from PyPI in its
#   two current forms (sglang-router 0.3.2, smg 1.13.0); lockstep in SGLang PD mode.
# Upstreams are nginx answering fixed SGLang /generate payloads: the prefill a JSON answer; the
# decode an SSE stream ("stream" mode, the decode on :31004 answers SSE to every request), or, in
# "json" mode, JSON or SSE as the request's "stream" field asks (the decode on :31002 reads the body
# through one internal nginx hop, a cost every target pays). lockstep always asks the decode for a
# stream (its barrier checks the first chunk); the gateways pass the client's choice through.
# wrk on loopback, concurrency 1 and 32; during each c=32 run also the CPU time (user + system,
# whole process tree) per request of the router and of the nginx serving the mocks (and the plain
# proxy). Every process started here is stopped by pid on exit.
# Usage: bash bench/pd_proxy.sh [seconds-per-run]   (needs wrk, nginx, python3; installs the peers
# into ~/.cache/lockstep-bench; fetches the default model for its tokenizer)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
DUR=${1:-8}
CACHE=${LOCKSTEP_BENCH_CACHE:-$HOME/.cache/lockstep-bench}
mkdir -p "$CACHE"
for tool in wrk nginx curl; do command -v $tool >/dev/null || { echo "install $tool (apt-get install wrk nginx curl)"; exit 1; }; done
for p in sglang-router==0.3.2 smg==1.13.0; do
  d="$CACHE/venv-${p%%==*}"
  [ -x "$d/bin/smg" ] || { python3 -m venv "$d" && "$d/bin/pip" install -q "$p"; }
done
MODEL=$(bash scripts/fetch-model.sh)
cargo build --release -q -p lockstep
cargo build --release -q -p lockstep-engine --example export_tokenizer

start_workdir

write_pd_upstreams
nginx -p "$WORK" -c "$WORK/nginx.conf" & PIDS+=($!); NGINX=$!

declare -A PID_OF # router port -> pid, for its CPU per request
gateway() { # venv port decode-port prometheus-port
  "$CACHE/$1/bin/smg" launch --pd-disaggregation --prefill http://127.0.0.1:31001 8998 --decode "http://127.0.0.1:$3" \
    --host 127.0.0.1 --port "$2" --prometheus-port "$4" --log-level error >"$WORK/logs/$1-$2.log" 2>&1 &
  PIDS+=($!); PID_OF[$2]=$!
}
gateway venv-sglang-router 31020 31002 31120
gateway venv-smg 31021 31002 31121
gateway venv-sglang-router 31022 31004 31122
gateway venv-smg 31023 31004 31123
# lockstep in front of SmolLM2's real tokenizer (byte-level BPE, the shape current models share),
# as a deployment would be: the config's mock tokenizer is word-level, which only the slower
# `tokenizers` crate path takes (3% of the c=32 throughput, 2026-12-01). Four instances: json and
# stream mode, each with busy polling as configured and off (lockstep's default).
target/release/examples/export_tokenizer "$MODEL" "$WORK" >/dev/null
for m in json stream; do
  for poll in on off; do
    case $m-$poll in
      json-on) ports='' ;;
      stream-on) ports='s/31030/31031/; s/31002/31004/' ;;
      json-off) ports='s/31030/31032/' ;;
      stream-off) ports='s/31030/31033/; s/31002/31004/' ;;
    esac
    off=''; [ $poll = off ] && off='s/^busy_poll_us = .*/busy_poll_us = 0/'
    sed -e "$ports; $off; s|^tokenizer = .*|tokenizer = \"$WORK/tokenizer.json\"|; s|\.\./config/|$PWD/config/|" \
      bench/pd-bench.toml > "$WORK/pd-bench-$m-$poll.toml"
    target/release/lockstep serve --config "$WORK/pd-bench-$m-$poll.toml" >"$WORK/logs/lockstep-$m-$poll.log" 2>&1 & PIDS+=($!)
    PID_OF[$(sed -n 's/^http_listen = "127.0.0.1:\([0-9]*\)"/\1/p' "$WORK/pd-bench-$m-$poll.toml")]=$!
  done
done

write_pd_bodies
# name:port per mode
TARGETS_json="direct:31002 nginx-proxy:31010 sglang-router-0.3.2:31020 smg-1.13.0:31021 lockstep:31030 lockstep-nopoll:31032"
TARGETS_stream="direct:31004 nginx-proxy:31011 sglang-router-0.3.2:31022 smg-1.13.0:31023 lockstep:31031 lockstep-nopoll:31033"

# Wait (bounded) until every target answers /generate with 200 and the decode's text.
for mode in json stream; do
  body_var=BODY_$mode; targets_var=TARGETS_$mode
  wait_answers /generate "${!body_var}" hello "${!targets_var}"
done

run() { wrk_run "$1" "$2" "$3" /generate; }
to_us() { awk -v v="$1" 'BEGIN{ if (v ~ /us$/) {sub(/us$/,"",v); print v+0} else if (v ~ /ms$/) {sub(/ms$/,"",v); print v*1000} else {sub(/s$/,"",v); print v*1000000} }'; }

declare -A R
HZ=$(getconf CLK_TCK)
per_req() { awk -v t="$1" -v hz="$HZ" -v r="$2" -v d="$DUR" 'BEGIN{printf "%.0f us", t / hz * 1e6 / (r * d)}'; } # TICKS RPS
for mode in stream json; do
  [ $mode = json ] && echo "### json mode: the client asks for a JSON answer (stream=false)" || echo "### stream mode: the client asks for a stream (stream=true)"
  echo
  echo "| target | c=1 req/s | c=1 p50 | c=1 p99 | c=32 req/s | c=32 p50 | c=32 p99 | router CPU/req at c=32 | nginx CPU/req at c=32 | non-2xx |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  targets_var=TARGETS_$mode
  for t in ${!targets_var}; do
    name=${t%%:*}; port=${t##*:}
    read -r r1 a1 b1 e1 < <(run "$port" 1 $mode)
    pid=${PID_OF[$port]:-}; [ -n "$pid" ] && c0=$(tree_cpu "$pid"); n0=$(tree_cpu "$NGINX")
    read -r r32 a32 b32 e32 < <(run "$port" 32 $mode)
    ncpu=$(per_req $(( $(tree_cpu "$NGINX") - n0 )) "$r32")
    cpu=-
    if [ -n "$pid" ]; then
      cpu=$(per_req $(( $(tree_cpu "$pid") - c0 )) "$r32")
      R[$mode.$name.cpu]=${cpu% us}
    fi
    R[$mode.$name.r1]=$r1; R[$mode.$name.p1]=$(to_us "$a1"); R[$mode.$name.r32]=$r32
    echo "| $name | $r1 | $a1 | $b1 | $r32 | $a32 | $b32 | $cpu | $ncpu | $((e1 + e32)) |"
  done
  d=${R[$mode.direct.p1]}
  best_gw_r32=$(awk -v a="${R[$mode.sglang-router-0.3.2.r32]}" -v b="${R[$mode.smg-1.13.0.r32]}" 'BEGIN{print (a>b)?a:b}')
  best_gw_add=$(awk -v a="${R[$mode.sglang-router-0.3.2.p1]}" -v b="${R[$mode.smg-1.13.0.p1]}" -v d="$d" 'BEGIN{x=a-d; y=b-d; print (x<y)?x:y}')
  ls_add=$(awk -v l="${R[$mode.lockstep.p1]}" -v d="$d" 'BEGIN{print l-d}')
  ng_add=$(awk -v l="${R[$mode.nginx-proxy.p1]}" -v d="$d" 'BEGIN{print l-d}')
  echo
  echo "- added p50 at c=1 over direct: nginx ${ng_add} us, better gateway ${best_gw_add} us, lockstep ${ls_add} us"
  np_add=$(awk -v l="${R[$mode.lockstep-nopoll.p1]}" -v d="$d" 'BEGIN{print l-d}')
  awk -v l="${R[$mode.lockstep.r32]}" -v g="$best_gw_r32" -v n="${R[$mode.nginx-proxy.r32]}" -v la="$ls_add" -v ga="$best_gw_add" \
      -v nl="${R[$mode.lockstep-nopoll.r32]}" -v na="$np_add" 'BEGIN{
    printf "- lockstep c=32 throughput: %.2fx the better gateway (target >= 3x), %.0f%% of nginx as a plain single-upstream proxy\n", l/g, 100*l/n;
    printf "- lockstep added p50 at c=1: %.2f of the better gateway'"'"'s (target <= 0.33)\n", la/ga;
    printf "- lockstep with busy polling off: %.2fx at c=32, added p50 %.2f of the better gateway'"'"'s\n", nl/g, na/ga }'
  awk -v l="${R[$mode.lockstep-nopoll.cpu]}" -v a="${R[$mode.sglang-router-0.3.2.cpu]}" -v b="${R[$mode.smg-1.13.0.cpu]}" 'BEGIN{
    printf "- router CPU per request at c=32 (busy polling off): lockstep %d us, sglang-router %d us, smg %d us: %.2f of the leaner gateway'"'"'s\n", l, a, b, l / ((a < b) ? a : b) }'
  echo
done
