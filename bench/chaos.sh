#!/usr/bin/env bash
# Chaos across processes (proxy/cli/tests/chaos.rs), more rounds than the one CI runs: router,
# prefill worker and decode worker as separate `lockstep` processes in network namespaces, on
# SmolLM2, under load from streaming and non-streaming clients. Each round: relay delay; kill -9
# and restart in place of the decode worker, then of the prefill worker; a partition between
# prefill and decode during KV pushes; the decode worker's link down and up; a decode worker that
# accepts and never answers; a SIGHUP storm. Then a drain (SIGTERM) under load. Fails on any
# answer that is neither its prompt's whole greedy text nor a typed error, and on anything held
# by the router or either worker after each fault; prints each fault's answers, typed errors by
# status and code, and recovery time (the fault's end to the first whole answer). Needs root.
#
#   bash bench/chaos.sh [ROUNDS]     (default: 3)
set -euo pipefail
cd "$(dirname "$0")/.."
export LOCKSTEP_MODEL=${LOCKSTEP_MODEL:-$(bash scripts/fetch-model.sh)}
export LOCKSTEP_REQUIRE_MODEL=1 LOCKSTEP_REQUIRE_NETNS=1
LOCKSTEP_CHAOS_ROUNDS=${1:-3} \
  cargo test --quiet -p lockstep --test chaos -- --nocapture 2>&1 \
  | grep -E '^\||test result|panicked|^  '
