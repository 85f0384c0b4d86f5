#!/usr/bin/env bash
# A/B of two lockstep binaries (before and after a change), interleaved round by round behind the
# same nginx upstreams as bench/pd_proxy.sh, so that run-to-run noise on a shared machine hits both
# alike. Prints one line per run (round, mode, binary, c=1 req/s and p50, c=32 req/s and p50) and
# the medians per mode and binary. Every process started here is stopped by pid on exit.
# Usage: bash bench/ab_lockstep.sh A_BINARY B_BINARY [seconds-per-run] [rounds]
#   e.g. build the base commit in a second checkout with its own CARGO_TARGET_DIR, then
#   bash bench/ab_lockstep.sh /tmp/base/target/release/lockstep target/release/lockstep
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
[ $# -ge 2 ] || { sed -n '2,8p' "$0"; exit 1; }
A=$(realpath "$1"); B=$(realpath "$2"); DUR=${3:-6}; ROUNDS=${4:-3}
for tool in wrk nginx curl; do command -v $tool >/dev/null || { echo "install $tool"; exit 1; }; done

start_workdir

write_pd_upstreams
nginx -p "$WORK" -c "$WORK/nginx.conf" & PIDS+=($!)
# A on :31030 (json) and :31031 (stream), B on :31040 and :31041.
config() { # listen-port decode-port -> file
  sed -e "s/31030/$1/; s/31002/$2/; s|\.\./config/|$PWD/config/|" bench/pd-bench.toml > "$WORK/$1.toml"
  echo "$WORK/$1.toml"
}
"$A" serve --config "$(config 31030 31002)" >"$WORK/logs/a-json.log" 2>&1 & PIDS+=($!)
"$A" serve --config "$(config 31031 31004)" >"$WORK/logs/a-stream.log" 2>&1 & PIDS+=($!)
"$B" serve --config "$(config 31040 31002)" >"$WORK/logs/b-json.log" 2>&1 & PIDS+=($!)
"$B" serve --config "$(config 31041 31004)" >"$WORK/logs/b-stream.log" 2>&1 & PIDS+=($!)
write_pd_bodies
wait_answers /generate "$BODY_json" hello "a:31030 b:31040"
wait_answers /generate "$BODY_stream" hello "a:31031 b:31041"

echo "| round | mode | binary | c=1 req/s | c=1 p50 | c=32 req/s | c=32 p50 |"
echo "| ---: | --- | --- | ---: | ---: | ---: | ---: |"
: > "$WORK/runs"
for round in $(seq 1 "$ROUNDS"); do
  for mode in stream json; do
    for bin in a b; do
      port=$([ $mode = json ] && echo 0 || echo 1)
      port=$([ $bin = a ] && echo $((31030 + port)) || echo $((31040 + port)))
      read -r r1 p1 _ _ < <(wrk_run "$port" 1 $mode /generate)
      read -r r32 p32 _ _ < <(wrk_run "$port" 32 $mode /generate)
      echo "| $round | $mode | $bin | $r1 | $p1 | $r32 | $p32 |"
      echo "$mode $bin $r32" >> "$WORK/runs"
    done
  done
done
echo
for mode in stream json; do
  for bin in a b; do
    m=$(awk -v m=$mode -v b=$bin '$1==m && $2==b {print $3}' "$WORK/runs" | sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
    echo "- $mode, binary $bin: median c=32 throughput $m req/s"
  done
done
