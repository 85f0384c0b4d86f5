#!/usr/bin/env bash
# Registers, shared memory and spills of every CUDA kernel for sm_90 (and sm_80), from ptxas.
# Needs NVRTC and ptxas 13.0 from PyPI (no GPU):
#   python3 -m pip install 'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-nvcc==13.0.*'
# The report is kept in gpu-engine/BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
CU13=$(python3 -c 'import nvidia, os; print(next(os.path.join(p, "cu13") for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cu13"))))')
export LD_LIBRARY_PATH="$CU13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PTXAS="$CU13/bin/ptxas"
[ -x "$PTXAS" ] || { echo "ptxas not found: pip install 'nvidia-cuda-nvcc==13.0.*'" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PTXAS" --version | tail -1
for sm in 90 80; do
    cargo run -q --release -p lockstep-engine --example dump_ptx -- "compute_$sm" "$tmp/k$sm.ptx"
    echo
    echo "sm_$sm | kernel | registers | shared (static) | stack | spill stores | spill loads"
    "$PTXAS" -arch="sm_$sm" -v "$tmp/k$sm.ptx" -o "$tmp/k$sm.cubin" 2>&1 | awk -v sm="$sm" '
        /Compiling entry function/ { gsub(/.*function .|. for .*/, ""); k = $0 }
        /bytes stack frame/ { st = $1; ss = $5; sl = $9 }
        /Used [0-9]+ registers/ {
            r = $0; sub(/.*Used /, "", r); sub(/ registers.*/, "", r)
            sm_ = "0"; if (match($0, /[0-9]+ bytes smem/)) { sm_ = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", sm_) }
            printf "sm_%s | %s | %s | %s B | %s B | %s B | %s B\n", sm, k, r, sm_, st, ss, sl
        }'
done
