#!/usr/bin/env bash
# Mutation testing of the router's pair lifecycle, backends and field table with cargo-mutants
# (crates.io): each mutant (a changed operator, a function body replaced by a default, ...) is
# built and the router's tests run against it; a mutant no test kills is "missed". Long (about
# 25 s a mutant on 2 cores: fields.rs has ~50, pair/ ~190, backend/ ~470), so not part of CI.
#
#   bash bench/mutants.sh                      # fields.rs, pair/machine.rs (the defaults)
#   bash bench/mutants.sh 'proxy/router/src/pair/*.rs' 'proxy/router/src/backend/*.rs'
#   MUTANTS_TESTS=workspace bash bench/mutants.sh ...   # every test binary (much longer)
#
# Results: mutants.out/ (missed.txt, caught.txt, timeout.txt, unviable.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --locked
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(proxy/router/src/http/fields.rs proxy/router/src/pair/machine.rs)
args=()
for f in "${files[@]}"; do args+=(-f "$f"); done
if [ "${MUTANTS_TESTS:-package}" = workspace ]; then
  scope=(--test-workspace=true)
else
  scope=(--test-package lockstep-router)
fi
exec cargo mutants "${args[@]}" "${scope[@]}" --timeout 180 --cap-lints true
