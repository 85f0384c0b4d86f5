#!/usr/bin/env bash
# The soak (tests/tests/soak.rs), longer and wider than the 60-second run CI makes: `lockstep
# probe` traffic (several tenants, every API and mode, clients leaving mid-stream, over-long
# prompts) through lockstep over the SGLang PD mock, which injects one fault kind after another
# 5% of the time, and over the embedded engine on SmolLM2, at once. It fails on any foreign
# content, any over-long prompt answered, anything left held at the end, or RSS / open files
# growing past 10% after the warm-up half; it prints each half's p99 (the drift).
#
#   bash bench/soak.sh [SECONDS] [CONCURRENCY]     (defaults: 240 s, 256 in flight)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-240}
CONC=${2:-256}
export LOCKSTEP_MODEL=${LOCKSTEP_MODEL:-$(bash scripts/fetch-model.sh)}
export LOCKSTEP_REQUIRE_MODEL=1
LOCKSTEP_SOAK_SECS=$SECS LOCKSTEP_SOAK_CONCURRENCY=$CONC \
  cargo test --quiet -p lockstep-tests --test soak -- --nocapture 2>&1 \
  | grep -E '^(soak:|--- |errors by kind|latency of|leaks|over-long|result:)|test result'
