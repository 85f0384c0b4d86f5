#!/usr/bin/env bash
# What sharing tenant limits through Redis (`[shared]`) costs a request, one run, side by side:
# lockstep in SGLang PD mode (nginx answering fixed /generate payloads, as bench/pd_proxy.sh) with
# one tenant whose request rate, concurrent pairs and token budget are all limited (high enough
# never to refuse), enforced (a) in the process, (b) in a local redis-server shared by two
# replicas (wrk against one, then against both at once). wrk on loopback, c=1 and c=32.
# Every process started here is stopped by pid on exit.
# Usage: bash bench/shared_limits.sh [seconds-per-run]   (needs wrk, nginx, redis-server, curl)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
DUR=${1:-8}
for tool in wrk nginx curl redis-server; do command -v $tool >/dev/null || { echo "install $tool"; exit 1; }; done
cargo build --release -q -p lockstep

start_workdir
write_pd_upstreams
nginx -p "$WORK" -c "$WORK/nginx.conf" & PIDS+=($!)
redis-server --port 31060 --bind 127.0.0.1 --save '' --appendonly no >"$WORK/logs/redis.log" 2>&1 & PIDS+=($!)

KEY=bench-key
HASH=$(printf %s "$KEY" | sha256sum | cut -d' ' -f1)
LIMITS="requests_per_second = 1000000
burst = 1000000
max_concurrent_pairs = 100000
tokens_per_minute = 100000000000"
config() { # port shared?
  sed -e "s/31030/$1/; s/31002/31004/; s|\.\./config/|$PWD/config/|; s/^busy_poll_us = .*/busy_poll_us = 0/" bench/pd-bench.toml
  printf '\n[[tenants]]\nname = "bench"\napi_keys_sha256 = ["%s"]\n%s\n' "$HASH" "$LIMITS"
  [ "$2" = shared ] && printf '\n[shared]\nredis_url = "redis://127.0.0.1:31060/0"\n'
  true
}
config 31050 local > "$WORK/local.toml"
config 31051 shared > "$WORK/shared-a.toml"
config 31052 shared > "$WORK/shared-b.toml"
for c in local shared-a shared-b; do
  target/release/lockstep serve --config "$WORK/$c.toml" >"$WORK/logs/lockstep-$c.log" 2>&1 & PIDS+=($!)
done

BODY='{"text":"hello world","stream":true,"sampling_params":{"max_new_tokens":1}}'
printf 'wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\nwrk.headers["Authorization"] = "Bearer %s"\n' "'$BODY'" "$KEY" > "$WORK/post_auth.lua"
for port in 31050 31051 31052; do
  ok=""
  for _ in $(seq 1 150); do
    if curl -sf -m 2 -H 'content-type: application/json' -H "authorization: Bearer $KEY" -d "$BODY" "http://127.0.0.1:$port/generate" | grep -q hello; then ok=1; break; fi
    sleep 0.2
  done
  [ -n "$ok" ] || { echo "lockstep on $port never answered"; tail -n 20 "$WORK"/logs/*; exit 1; }
done

to_us() { awk -v v="$1" 'BEGIN{ if (v ~ /us$/) {sub(/us$/,"",v); print v+0} else if (v ~ /ms$/) {sub(/ms$/,"",v); print v*1000} else {sub(/s$/,"",v); print v*1000000} }'; }
declare -A R
echo "| limits | c=1 req/s | c=1 p50 | c=32 req/s | c=32 p50 | c=32 p99 | non-2xx |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for t in local:31050 shared:31051; do
  name=${t%%:*}; port=${t##*:}
  read -r r1 a1 _ e1 < <(wrk_run "$port" 1 auth /generate)
  read -r r32 a32 b32 e32 < <(wrk_run "$port" 32 auth /generate)
  R[$name.r1]=$r1; R[$name.p1]=$(to_us "$a1"); R[$name.r32]=$r32
  echo "| $name (one replica) | $r1 | $a1 | $r32 | $a32 | $b32 | $((e1 + e32)) |"
done
# Two replicas on one Redis, each driven at c=16 at once: one limit, the load split.
wrk_run 31051 16 auth /generate > "$WORK/a.out" & A=$!
wrk_run 31052 16 auth /generate > "$WORK/b.out" & B=$!
wait $A $B
read -r ra pa qa ea < "$WORK/a.out"; read -r rb pb qb eb < "$WORK/b.out"
echo "| shared (two replicas, c=16 each) | - | - | $(awk -v a="$ra" -v b="$rb" 'BEGIN{print a+b}') | $pa / $pb | $qa / $qb | $((ea + eb)) |"
echo
awk -v l1="${R[local.r1]}" -v s1="${R[shared.r1]}" -v l32="${R[local.r32]}" -v s32="${R[shared.r32]}" \
    -v lp="${R[local.p1]}" -v sp="${R[shared.p1]}" 'BEGIN{
  printf "- shared / local throughput: c=1 %.2fx, c=32 %.2fx; added p50 at c=1: %.0f us (one Redis round trip and its script)\n", s1/l1, s32/l32, sp-lp }'
echo "- redis-server: $(redis-server --version | cut -d' ' -f3); CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
