#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of untrusted input (cargo-fuzz, libFuzzer, address
# sanitizer) on the stable toolchain (RUSTC_BOOTSTRAP=1 enables the nightly flags it needs).
#
#   bash bench/fuzz.sh [TARGET|all] [SECS]        default: all targets, 60 s each
#
# Targets (bodies in tests/src/fuzz.rs): gguf, kv_transfer, worker_messages, data_stream, sse,
# upstream_json, admission, chat_template, bpe, responses, messages, tool_output, grammar,
# ext_proc, kv_events. Each run grows fuzz/corpus/TARGET (minimized after
# the run; commit it: CI replays it through `cargo test`, tests/tests/fuzz_replay.rs), leaves any
# crash reproducer in fuzz/artifacts/TARGET (fix it, then copy it to fuzz/regressions/TARGET),
# and appends its seconds and executions to fuzz/LOG.md.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1

all="gguf kv_transfer worker_messages data_stream sse upstream_json admission chat_template bpe responses messages tool_output grammar ext_proc kv_events"
which=${1:-all}
secs=${2:-60}
[ "$which" = all ] && targets=$all || targets=$which

# Seeds for a target that has no corpus yet.
for t in $targets; do
    if [ -z "$(ls -A "fuzz/corpus/$t" 2>/dev/null)" ]; then
        cargo run -q -p lockstep-tests --example fuzz_seeds -- fuzz/corpus
        break
    fi
done

cargo fuzz build
[ -f fuzz/LOG.md ] || printf '# Fuzzing log\n\n| date (UTC) | target | seconds | executions | result |\n|---|---|---|---|---|\n' > fuzz/LOG.md
failed=0
for t in $targets; do
    log=$(mktemp)
    set +e
    cargo fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 \
        -timeout=20 -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -n1)
    if [ "$rc" = 0 ]; then result=clean; else result="CRASH (exit $rc, see fuzz/artifacts/$t)"; failed=1; tail -n 40 "$log"; fi
    printf '| %s | %s | %s | %s | %s |\n' "$(date -u +%F)" "$t" "$secs" "${execs:-?}" "$result" >> fuzz/LOG.md
    echo "$t: $secs s, ${execs:-?} executions, $result"
    rm -f "$log"
    # Keep the corpus small: only inputs that add coverage.
    cargo fuzz cmin "$t" "fuzz/corpus/$t" >/dev/null 2>&1 || true
done
exit $failed
