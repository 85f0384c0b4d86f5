#!/usr/bin/env bash
# Distributed mode against single-process mode, in one run on this machine: the KV transfer
# between two workers (the worker data plane and gRPC PushKv, against a plain TCP copy of the same
# bytes), then end to end through HTTP (bench/e2e_http.py: a 512-token prompt's first token, one
# stream's decode rate, 8 concurrent requests) for
#   - single process: `lockstep serve` with the embedded split engines (prefill + decode);
#   - distributed: `lockstep serve` (backend = "lockstep") + one prefill worker + one decode
#     worker, three processes on loopback.
# On one small machine the workers share the cores the single process has to itself, and every
# KV set crosses loopback: this measures the cost of going distributed, not a speedup. A
# benchmark, not a test: run it by hand.
#
#   bash bench/distributed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(bash scripts/fetch-model.sh)
cargo build --release --quiet -p lockstep --bin lockstep
cargo build --release --quiet -p lockstep-worker --example kv_transfer_bench
BIN=target/release/lockstep
DIR=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() {
  for _ in $(seq 1 600); do
    python3 -c "import urllib.request; urllib.request.urlopen('$1', timeout=1)" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "not ready: $1" >&2; return 1
}

KV=$(target/release/examples/kv_transfer_bench --pages 64 --sets 20 | tail -n 1)
KV_TLS=$(target/release/examples/kv_transfer_bench --pages 64 --sets 20 --tls | tail -n 1)

ENGINE="kv_pages = 640
page_size = 16
max_batch_tokens = 256
max_running = 16"
cat > "$DIR/single.toml" <<TOML
[server]
log_level = "warn"
[[models]]
name = "SmolLM2-135M-Instruct"
backend = "embedded"
context_window = 8192
kv_capacity_tokens = 10240
[models.engine]
gguf = "$MODEL"
fetch_pip = ""
$ENGINE
[models.timeouts]
prefill_ms = 300000
first_token_ms = 330000
idle_ms = 60000
total_ms = 900000
TOML
PORT=$(free_port)
"$BIN" serve --config "$DIR/single.toml" --http-listen "127.0.0.1:$PORT" & PIDS+=($!)
wait_ready "http://127.0.0.1:$PORT/ready"
SINGLE=$(python3 bench/e2e_http.py "http://127.0.0.1:$PORT" SmolLM2-135M-Instruct)
kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true

cat > "$DIR/worker.toml" <<TOML
[worker]
log_level = "warn"
[engine]
gguf = "$MODEL"
fetch_pip = ""
$ENGINE
TOML
PP=$(free_port); DP=$(free_port)
"$BIN" worker --role prefill --config "$DIR/worker.toml" --listen "127.0.0.1:$PP" & PIDS+=($!)
"$BIN" worker --role decode --config "$DIR/worker.toml" --listen "127.0.0.1:$DP" & PIDS+=($!)
wait_ready "http://127.0.0.1:$PP/health"
wait_ready "http://127.0.0.1:$DP/health"
sed -e 's/backend = "embedded"/backend = "lockstep"/' -e '/^kv_pages\|^page_size\|^max_batch_tokens\|^max_running/d' \
  "$DIR/single.toml" > "$DIR/router.toml"
cat >> "$DIR/router.toml" <<TOML
[models.prefill]
workers = [{ url = "http://127.0.0.1:$PP" }]
[models.decode]
workers = [{ url = "http://127.0.0.1:$DP" }]
TOML
PORT=$(free_port)
"$BIN" serve --config "$DIR/router.toml" --http-listen "127.0.0.1:$PORT" & PIDS+=($!)
wait_ready "http://127.0.0.1:$PORT/ready"
DIST=$(python3 bench/e2e_http.py "http://127.0.0.1:$PORT" SmolLM2-135M-Instruct)

python3 - "$KV" "$SINGLE" "$DIST" "$KV_TLS" <<'PY'
import json, sys
kv, single, dist, kv_tls = (json.loads(a) for a in sys.argv[1:5])
print(f"KV transfer, {kv['pages']} pages of 368,640 B per set, {kv['sets']} sets:")
print(f"  worker data plane {kv['data_plane_gbps']:.2f} GB/s, gRPC PushKv {kv['grpc_gbps']:.2f} GB/s, "
      f"plain TCP copy {kv['tcp_gbps']:.2f} GB/s -> data plane {100 * kv['data_plane_ratio']:.0f}%, "
      f"PushKv {100 * kv['grpc_ratio']:.0f}% of TCP")
print(f"  under mutual TLS: worker data plane {kv_tls['data_plane_gbps']:.2f} GB/s, gRPC PushKv "
      f"{kv_tls['grpc_gbps']:.2f} GB/s ({kv_tls['data_plane_gbps'] / kv['data_plane_gbps']:.2f}x and "
      f"{kv_tls['grpc_gbps'] / kv['grpc_gbps']:.2f}x plaintext)")
print(f"{'end to end (HTTP)':<34}{'single':>10}{'distributed':>13}{'ratio':>8}")
for k in single:
    if isinstance(single[k], (int, float)) and k in dist and single[k]:
        print(f"{k:<34}{single[k]:>10.2f}{dist[k]:>13.2f}{dist[k] / single[k]:>7.2f}x")
PY
