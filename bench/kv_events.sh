#!/usr/bin/env bash
# The prefix cache hit rate the workers report, `policy = "prefix_aware"` (each replica's own
# record of what it routed where) against `"prefix_events"` (the engines' KV events), with 1, 2
# and 4 lockstep replicas in front of four SGLang prefill servers (the PD mock, each with its own
# prefix cache publishing KV events as SGLang 0.5.23 does), on a multi-turn, multi-tenant
# workload: 15 conversations of two tenants, 6 turns each (a one-block system prompt per tenant,
# three blocks of history a turn), sent to the replicas in turn. A quality figure, not a speed
# one: the same in a debug build. Everything runs in-process and stops with the test.
# Usage: bash bench/kv_events.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test -q -p lockstep-tests --test kv_events hit_rate_table -- --ignored --nocapture 2>&1 \
  | grep '^|'
