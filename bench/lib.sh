# Shared by the wrk benchmarks (bench/pd_proxy.sh, bench/vllm_pd.sh); sourced, never run.
# Expects WORK (with post_<mode>.lua scripts) and DUR to be set.

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
