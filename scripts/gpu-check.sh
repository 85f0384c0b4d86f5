#!/usr/bin/env bash
# The GPU check (issue 5), in two halves:
#   bash scripts/gpu-check.sh build   # here: builds the check binary into .gpu/ (git-ignored)
#   bash scripts/gpu-check.sh run     # on the GPU machine (no Rust there): runs it
# `run` finds the driver, NVRTC and cuBLAS libraries the machine has, prints the GPU, and runs
# gpu-engine/examples/gpu_check.rs (kernels vs CPU, model agreement, device tag check, timings)
# under a 5-minute limit; its table comes last. `dry-run` runs the CPU side on any machine.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-run}" in
build)
    cargo build --release -p lockstep-engine --example gpu_check
    mkdir -p .gpu
    cp target/release/examples/gpu_check .gpu/gpu_check
    ls -l .gpu/gpu_check
    ;;
dry-run)
    cargo run --release -p lockstep-engine --example gpu_check -- --dry-run
    ;;
run)
    dirs=""
    for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13; do
        for root in /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/local/cuda /usr/local/cuda-13.0 \
            /opt/torch/.venv/lib/python3.12/site-packages/nvidia; do
            [ -d "$root" ] || continue
            hit=$(find -L "$root" -maxdepth 4 -name "$lib" 2>/dev/null | head -1)
            if [ -n "$hit" ]; then
                dirs="$dirs:$(dirname "$hit")"
                break
            fi
        done
    done
    export LD_LIBRARY_PATH="${dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
    log="${OUT:-/tmp}/gpu_check.log"
    shift || true
    timeout 300 ./.gpu/gpu_check "$@" 2>&1 | tee "$log"
    ;;
*)
    echo "usage: $0 build|run|dry-run" >&2
    exit 2
    ;;
esac
