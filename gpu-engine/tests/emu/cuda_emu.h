// A small CUDA execution model on CPU threads, enough to run lockstep's kernels (kernels.cu)
// unchanged and check their logic without a GPU: blocks run one after another; each block's
// threads are real threads, so __syncthreads is a barrier of the block and a warp shuffle is an
// exchange through a barrier of the 32 lanes of a warp. Shared memory is process-wide (one
// block at a time), f16 conversions use the compiler's _Float16 (round to nearest even, as the
// PTX cvt.rn). Threads that return early drop out of their barriers, as exited GPU threads do.
// It checks indexing, reductions, shuffles, masking and tag checks; it says nothing about speed,
// memory coalescing or races that only a real device's scheduling would expose.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
    unsigned x, y, z, w;
};

struct EmuWarp {
    std::barrier<> bar{32};
    uint64_t slots[32];
};

struct EmuBlock {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<EmuWarp>> warps;
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
inline thread_local EmuBlock* emu_block = nullptr;
inline std::vector<unsigned char> emu_smem;

inline void* emu_dyn_smem() { return emu_smem.data(); }

#define __global__
#define __device__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(emu_dyn_smem())

inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int offset) {
    static_assert(sizeof(T) <= 8);
    EmuWarp& w = *emu_block->warps[threadIdx.x / 32];
    unsigned lane = threadIdx.x % 32;
    uint64_t raw = 0;
    std::memcpy(&raw, &v, sizeof(T));
    w.slots[lane] = raw;
    w.bar.arrive_and_wait();
    uint64_t got = w.slots[lane ^ (unsigned)offset];
    w.bar.arrive_and_wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

inline unsigned atomicCAS(unsigned* addr, unsigned expected, unsigned desired) {
    __atomic_compare_exchange_n(addr, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return expected;
}

inline float __int_as_float(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float __int_as_float(int bits) { return __int_as_float((unsigned)bits); }

inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;

inline float h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short f2h(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

// Runs `body` over the grid, one block at a time. The block's threads are created once per
// launch and step through the blocks together (a launch-wide barrier between blocks); each
// block gets fresh block and warp barriers, so threads that returned early from one block are
// full participants again in the next.
inline void emu_launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
    emu_smem.assign(smem, 0xA5);  // garbage, never zeros: kernels must not rely on them
    unsigned n = block.x * block.y * block.z;
    unsigned nblocks = grid.x * grid.y * grid.z;
    std::barrier<> between(n);
    EmuBlock cur;
    auto fresh = [&] {
        cur.bar = std::make_unique<std::barrier<>>(n);
        cur.warps.clear();
        for (unsigned w = 0; w < (n + 31) / 32; w++) cur.warps.push_back(std::make_unique<EmuWarp>());
    };
    fresh();
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            blockDim = block;
            gridDim = grid;
            for (unsigned k = 0; k < nblocks; k++) {
                blockIdx = {k % grid.x, (k / grid.x) % grid.y, k / (grid.x * grid.y)};
                emu_block = &cur;
                body();
                // An exited thread no longer holds back its block's or warp's barriers.
                cur.bar->arrive_and_drop();
                cur.warps[t / 32]->bar.arrive_and_drop();
                between.arrive_and_wait();  // every thread is done with this block
                if (t == 0) {
                    std::memset(emu_smem.data(), 0xA5, emu_smem.size());
                    fresh();
                }
                between.arrive_and_wait();  // the next block's barriers are ready
            }
        });
    }
    for (auto& th : threads) th.join();
}
