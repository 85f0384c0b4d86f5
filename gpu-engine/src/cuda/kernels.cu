// lockstep's CUDA kernels, compiled at run time by NVRTC (sm_80 and later; tuned for sm_90).
//
// Layouts (all row-major):
// - activations `x`: tokens × dim, f32 (the residual stream); GEMM inputs are f16.
// - `qkv`: tokens × (heads + 2·kv_heads) × head_dim, f32, straight out of the fused QKV GEMM.
// - KV pool: one allocation of pages; a page is layers × {K, V} × kv_heads × page_size × head_dim
//   f16, exactly the CPU pool's page layout, so a page's bytes (and their checksum) are the same
//   on both sides.
// - page tables: every item's entries are consecutive in `tbl_page` / `tbl_owner` / `tbl_epoch`
//   from `tbl_off[item]`: the page and the (owner, epoch) tag the reader holds for it.
// - tags: `tag_owner[page]`, `tag_epoch[page]`, mirrored from the pool's bookkeeping each step.
// - `flag`: flag[0] = 0 while every checked page matched; else 1 (foreign owner) or 2 (stale
//   epoch), and flag[1] the first page seen wrong. Read back once per step.

// No headers: NVRTC 13 ships no cuda_fp16.h, so f16 values travel as their 16-bit patterns
// (`f16`) and convert with the PTX cvt instructions (round to nearest even, as the CPU does).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short f16;

#define NEG_INF __int_as_float(0xff800000)

// Query heads per attention block: larger GQA groups use several blocks per KV head.
#define MAXG 4

// The shared-memory buffer sized at launch. (tests/emu, which runs these kernels on the CPU
// to check their logic without a GPU, defines LOCKSTEP_EMU and supplies both of these.)
#ifndef LOCKSTEP_EMU
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]

__device__ __forceinline__ float h2f(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16 f2h(float f) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ bool tag_ok(const u64* __restrict__ tag_owner,
                                       const u64* __restrict__ tag_epoch, int page, u64 owner,
                                       u64 epoch, u32* flag) {
    u64 o = tag_owner[page];
    u64 e = tag_epoch[page];
    if (o == owner && e == epoch) return true;
    u32 kind = (o != owner) ? 1u : 2u;
    if (atomicCAS(flag, 0u, kind) == 0u) flag[1] = (u32)page;
    return false;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < nw ? shared32[lane] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = lane < nw ? shared32[lane] : NEG_INF;
    return warp_max(t);
}

// x[t] = table[tokens[t]] (f16 table row → f32). Grid: tokens.
extern "C" __global__ void embed_gather(const f16* __restrict__ table,
                                        const int* __restrict__ tokens, float* __restrict__ x,
                                        int d) {
    int t = blockIdx.x;
    const f16* row = table + (size_t)tokens[t] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[(size_t)t * d + i] = h2f(row[i]);
}

// out[r] = x[rows[r]] · rsqrt(mean(x²) + eps) · w, as f16. Grid: output rows; block: 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const int* __restrict__ rows,
                                    const float* __restrict__ w, f16* __restrict__ out, int d,
                                    float eps) {
    __shared__ float s32[32];
    int r = blockIdx.x;
    const float* xr = x + (size_t)rows[r] * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, s32);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[(size_t)r * d + i] = f2h(xr[i] * inv * w[i]);
}

// RoPE (GGUF "normal" layout: pairs (2i, 2i+1) rotate by pos · base^(-2i/hd)) on the q and k
// heads of each token's qkv row, in place; then K and V are written as f16 into the token's page
// slot, but only if the page's tag is the one the writer's table holds (else the flag is raised
// and nothing is written). Grid: tokens; block: 128.
extern "C" __global__ void rope_kv_write(
    float* __restrict__ qkv, const int* __restrict__ tok_pos, const int* __restrict__ tok_item,
    const int* __restrict__ tbl_off, const int* __restrict__ tbl_page,
    const u64* __restrict__ tbl_owner, const u64* __restrict__ tbl_epoch,
    const u64* __restrict__ tag_owner, const u64* __restrict__ tag_epoch, u32* flag,
    f16* __restrict__ kv, int layer, int heads, int kv_heads, int hd, int page_size,
    long long page_elems, float rope_base) {
    int t = blockIdx.x;
    int pos = tok_pos[t];
    int item = tok_item[t];
    int width = (heads + 2 * kv_heads) * hd;
    float* row = qkv + (size_t)t * width;
    int half_hd = hd / 2;
    int npairs = (heads + kv_heads) * half_hd;
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        int i = p % half_hd, h = p / half_hd;
        float inv = powf(rope_base, -2.0f * (float)i / (float)hd);
        float s, c;
        sincosf((float)pos * inv, &s, &c);
        float a = row[h * hd + 2 * i], b = row[h * hd + 2 * i + 1];
        row[h * hd + 2 * i] = a * c - b * s;
        row[h * hd + 2 * i + 1] = a * s + b * c;
    }
    __syncthreads();
    int e = tbl_off[item] + pos / page_size;
    int slot = pos % page_size;
    int page = tbl_page[e];
    bool ok;
    if (threadIdx.x == 0) {
        ok = tag_ok(tag_owner, tag_epoch, page, tbl_owner[e], tbl_epoch[e], flag);
    } else {
        ok = tag_owner[page] == tbl_owner[e] && tag_epoch[page] == tbl_epoch[e];
    }
    if (!ok) return;
    f16* pg = kv + (size_t)page * (size_t)page_elems;
    for (int j = threadIdx.x; j < kv_heads * hd; j += blockDim.x) {
        int kh = j / hd, dd = j % hd;
        size_t ko = ((size_t)(layer * 2) * kv_heads + kh) * page_size * hd + (size_t)slot * hd + dd;
        size_t vo =
            ((size_t)(layer * 2 + 1) * kv_heads + kh) * page_size * hd + (size_t)slot * hd + dd;
        pg[ko] = f2h(row[(heads + kh) * hd + dd]);
        pg[vo] = f2h(row[(heads + kv_heads + kh) * hd + dd]);
    }
}

__device__ __forceinline__ void load8(const f16* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        out[2 * j] = h2f((f16)(w[j] & 0xffffu));
        out[2 * j + 1] = h2f((f16)(w[j] >> 16));
    }
}

// Paged attention, split over the context. One row per query token: row r belongs to item
// row_item[r] and sits at position row_pos[r], so it attends to positions 0..=row_pos[r] of that
// item's page table (decode: one row per sequence; prefill: one row per prompt token, causal).
// Grid: (rows, kv_heads · ceil(group / MAXG), splits); block: 128 threads (4 warps). Each block
// handles `chunk` positions (a multiple of page_size) for up to MAXG query heads sharing one KV
// head (GQA: each K/V row is read once for them all), checks the tag of every page it reads, and writes
// unnormalised partial results (o, running max m, sum l) for attn_reduce.
// Each token's K row is read by HD/8 lanes, 16 bytes each.
template <int HD>
__device__ void paged_attention_split(
    const float* __restrict__ qkv, const int* __restrict__ row_item,
    const int* __restrict__ row_pos, const int* __restrict__ tbl_off,
    const int* __restrict__ tbl_page, const u64* __restrict__ tbl_owner,
    const u64* __restrict__ tbl_epoch, const u64* __restrict__ tag_owner,
    const u64* __restrict__ tag_epoch, u32* flag, const f16* __restrict__ kv, int layer,
    int heads, int kv_heads, int page_size, long long page_elems, int chunk, int splits,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LPT = HD / 8;       // lanes per token
    constexpr int TPW = 32 / LPT;     // tokens per warp pass
    constexpr int NW = 4;             // warps
    constexpr int TPB = TPW * NW;     // tokens per block pass
    DYNAMIC_SHARED(float, smem);  // scores[MAXG][chunk], then red[NW][MAXG][HD]
    __shared__ float s32[32];
    float* scores = smem;
    float* red = smem + MAXG * chunk;

    int r = blockIdx.x, split = blockIdx.z;
    int group = heads / kv_heads;
    int gblocks = (group + MAXG - 1) / MAXG;
    int kvh = blockIdx.y / gblocks;
    int h0 = kvh * group + (blockIdx.y % gblocks) * MAXG;  // first query head of this block
    int ng = min(MAXG, kvh * group + group - h0);          // query heads in this block
    int item = row_item[r];
    int ctx = row_pos[r] + 1;
    int start = split * chunk;
    size_t part = ((size_t)r * heads + h0) * splits + split;
    if (start >= ctx) {
        // No positions here: an empty partial that attn_reduce skips.
        if (threadIdx.x < ng) {
            size_t p = part + (size_t)threadIdx.x * splits;
            part_ml[2 * p] = NEG_INF;
            part_ml[2 * p + 1] = 0.0f;
        }
        return;
    }
    int end = min(start + chunk, ctx);
    int n = end - start;
    int off = tbl_off[item];

    // Tags of every page this block reads.
    int first_page = start / page_size, npages = (end - 1) / page_size - first_page + 1;
    for (int i = threadIdx.x; i < npages; i += blockDim.x) {
        int e = off + first_page + i;
        tag_ok(tag_owner, tag_epoch, tbl_page[e], tbl_owner[e], tbl_epoch[e], flag);
    }

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int sub = lane % LPT, tok_in_warp = lane / LPT;
    float scale = rsqrtf((float)HD);
    const int width = (heads + 2 * kv_heads) * HD;
    float q[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            q[g][j] = g < ng ? qkv[(size_t)r * width + (h0 + g) * HD + sub * 8 + j] * scale
                                : 0.0f;
    }
    size_t k_base = ((size_t)(layer * 2) * kv_heads + kvh) * page_size * HD + sub * 8;
    size_t v_base = ((size_t)(layer * 2 + 1) * kv_heads + kvh) * page_size * HD + sub * 8;

    // Pass 1: scores.
    for (int base = start + warp * TPW; base < end; base += TPB) {
        int tok = base + tok_in_warp;
        bool valid = tok < end;
        float k[8];
        if (valid) {
            int page = tbl_page[off + tok / page_size];
            load8(kv + (size_t)page * page_elems + k_base + (size_t)(tok % page_size) * HD, k);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) k[j] = 0.0f;
        }
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < ng) {
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) s += q[g][j] * k[j];
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (valid && sub == 0) scores[g * chunk + (tok - start)] = s;
            }
        }
    }
    __syncthreads();

    // Pass 2: softmax numerators per head (max, exp, sum).
    float m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < ng) {
            float mx = NEG_INF;
            for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, scores[g * chunk + i]);
            mx = block_max(mx, s32);
            float sum = 0.0f;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                float p = expf(scores[g * chunk + i] - mx);
                scores[g * chunk + i] = p;
                sum += p;
            }
            sum = block_sum(sum, s32);
            m[g] = mx;
            l[g] = sum;
        }
    }
    __syncthreads();

    // Pass 3: probabilities × V.
    float acc[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    for (int base = start + warp * TPW; base < end; base += TPB) {
        int tok = base + tok_in_warp;
        if (tok < end) {
            int page = tbl_page[off + tok / page_size];
            float v[8];
            load8(kv + (size_t)page * page_elems + v_base + (size_t)(tok % page_size) * HD, v);
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < ng) {
                    float p = scores[g * chunk + (tok - start)];
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[g][j] += p * v[j];
                }
            }
        }
    }
    // Reduce over the tokens of a warp (lanes with the same `sub`), then over warps.
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g < ng) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float a = acc[g][j];
#pragma unroll
                for (int o = LPT; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                acc[g][j] = a;
            }
        }
    }
    if (tok_in_warp == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; g++)
            if (g < ng)
#pragma unroll
                for (int j = 0; j < 8; j++) red[(warp * MAXG + g) * HD + sub * 8 + j] = acc[g][j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ng * HD; i += blockDim.x) {
        int g = i / HD, dim = i % HD;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) s += red[(w * MAXG + g) * HD + dim];
        size_t p = part + (size_t)g * splits;
        part_o[p * HD + dim] = s;
    }
    if (threadIdx.x < ng) {
        int g = threadIdx.x;
        size_t p = part + (size_t)g * splits;
        // m and l are the same in every thread; pick them by index without dynamic indexing.
        float mg = 0.0f, lg = 0.0f;
#pragma unroll
        for (int gg = 0; gg < MAXG; gg++)
            if (gg == g) {
                mg = m[gg];
                lg = l[gg];
            }
        part_ml[2 * p] = mg;
        part_ml[2 * p + 1] = lg;
    }
}

#define ATTN_ARGS                                                                              \
    const float *__restrict__ qkv, const int *__restrict__ row_item,                           \
        const int *__restrict__ row_pos, const int *__restrict__ tbl_off,                      \
        const int *__restrict__ tbl_page, const u64 *__restrict__ tbl_owner,                  \
        const u64 *__restrict__ tbl_epoch, const u64 *__restrict__ tag_owner,                 \
        const u64 *__restrict__ tag_epoch, u32 *flag, const f16 *__restrict__ kv, int layer, \
        int heads, int kv_heads, int page_size, long long page_elems, int chunk, int splits,    \
        float *__restrict__ part_o, float *__restrict__ part_ml
#define ATTN_PASS                                                                            \
    qkv, row_item, row_pos, tbl_off, tbl_page, tbl_owner, tbl_epoch, tag_owner, tag_epoch, flag, \
        kv, layer, heads, kv_heads, page_size, page_elems, chunk, splits, part_o, part_ml

extern "C" __global__ void __launch_bounds__(128, 4) paged_attention_hd64(ATTN_ARGS) {
    paged_attention_split<64>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 4) paged_attention_hd128(ATTN_ARGS) {
    paged_attention_split<128>(ATTN_PASS);
}

// Combines the splits of each (row, head): out = Σ o_s·e^(m_s−M) / Σ l_s·e^(m_s−M), as f16.
// Grid: (rows, heads); block: hd threads.
extern "C" __global__ void attn_reduce(const float* __restrict__ part_o,
                                       const float* __restrict__ part_ml, int heads, int hd,
                                       int splits, f16* __restrict__ out) {
    int r = blockIdx.x, h = blockIdx.y, dim = threadIdx.x;
    size_t p0 = ((size_t)r * heads + h) * splits;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[2 * (p0 + s)]);
    float o = 0.0f, l = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[2 * (p0 + s)];
        if (ms == NEG_INF) continue;
        float w = expf(ms - mx);
        l += part_ml[2 * (p0 + s) + 1] * w;
        o += part_o[(p0 + s) * hd + dim] * w;
    }
    out[((size_t)r * heads + h) * hd + dim] = f2h(o / l);
}

// out[t][i] = silu(gu[t][i]) · gu[t][f + i] as f16 (gu: tokens × 2f from the fused gate/up GEMM).
extern "C" __global__ void silu_mul(const float* __restrict__ gu, f16* __restrict__ out, int f,
                                    long long total) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    long long t = idx / f, i = idx % f;
    float g = gu[t * 2 * f + i], u = gu[t * 2 * f + f + i];
    out[idx] = f2h(g / (1.0f + expf(-g)) * u);
}

// The warp's largest (value, index), the lower index on ties, in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) {
            best = ov;
            idx = oi;
        }
    }
}

// Index of the largest value of each row (the first on ties). Grid: rows; block: 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int n,
                                       int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* row = logits + (size_t)blockIdx.x * n;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v > best) {
            best = v;
            idx = i;
        }
    }
    warp_argmax(best, idx);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        warp_argmax(best, idx);
        if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
    }
}

// ---- XXH3-64 (seed 0, default secret) of whole pages, bit-identical to the CPU's xxh3_64. ----
// Inputs are over 240 bytes (the long-input path). Eight threads per page, one per accumulator:
// within a 1 KiB block every stripe's contribution to an accumulator is a sum, so each thread
// adds its own; the scramble after each block and the final merge are per accumulator too.

__constant__ unsigned char XXH_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

__device__ __forceinline__ u64 secret64(int at) {
    u64 v = 0;
#pragma unroll
    for (int i = 7; i >= 0; i--) v = (v << 8) | (u64)XXH_SECRET[at + i];
    return v;
}

// This accumulator's share of one 64-byte stripe: acc[i] += data[i ^ 1] + lo32(key)·hi32(key).
__device__ __forceinline__ u64 xxh_stripe(const u64* stripe, int secret_at, int lane) {
    u64 key = stripe[lane] ^ secret64(secret_at + 8 * lane);
    return stripe[lane ^ 1] + (u64)(u32)key * (u64)(u32)(key >> 32);
}

// Grid: ceil(pages / 8); block: 64 (eight pages, eight threads each). `page_bytes` is a multiple
// of 8 and over 240.
extern "C" __global__ void xxh3_pages(const unsigned char* __restrict__ base,
                                      const int* __restrict__ pages, int npages,
                                      long long page_bytes, u64* __restrict__ out) {
    __shared__ u64 accs[8][8];
    const u64 P32_1 = 0x9E3779B1ull, P32_2 = 0x85EBCA77ull, P32_3 = 0xC2B2AE3Dull;
    const u64 P64_1 = 0x9E3779B185EBCA87ull, P64_2 = 0xC2B2AE3D27D4EB4Full,
              P64_3 = 0x165667B19E3779F9ull, P64_4 = 0x85EBCA77C2B2AE63ull,
              P64_5 = 0x27D4EB2F165667C5ull;
    int slot = threadIdx.x >> 3, lane = threadIdx.x & 7;
    int pi = blockIdx.x * 8 + slot;
    u64 init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    u64 acc = 0;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i == lane) acc = init[i];
    u64 len = (u64)page_bytes;
    if (pi < npages) {
        const unsigned char* in = base + (size_t)pages[pi] * (size_t)page_bytes;
        const u64 block_len = 1024;  // 16 stripes per block with the 192-byte secret
        u64 nb_blocks = (len - 1) / block_len;
        for (u64 b = 0; b < nb_blocks; b++) {
            const u64* blk = reinterpret_cast<const u64*>(in + b * block_len);
#pragma unroll 4
            for (int s = 0; s < 16; s++) acc += xxh_stripe(blk + 8 * s, 8 * s, lane);
            acc ^= acc >> 47;
            acc ^= secret64(192 - 64 + 8 * lane);
            acc *= P32_1;
        }
        u64 ns = ((len - 1) - block_len * nb_blocks) / 64;
        const u64* last = reinterpret_cast<const u64*>(in + nb_blocks * block_len);
        for (u64 s = 0; s < ns; s++) acc += xxh_stripe(last + 8 * s, 8 * (int)s, lane);
        acc += xxh_stripe(reinterpret_cast<const u64*>(in + len - 64), 192 - 64 - 7, lane);
    }
    accs[slot][lane] = acc;
    __syncthreads();
    if (pi < npages && lane == 0) {
        u64 result = len * P64_1;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u64 a = accs[slot][2 * i] ^ secret64(11 + 16 * i);
            u64 b = accs[slot][2 * i + 1] ^ secret64(11 + 16 * i + 8);
            result += (a * b) ^ __umul64hi(a, b);
        }
        result ^= result >> 37;
        result *= 0x165667919E3779F9ull;
        result ^= result >> 32;
        out[pi] = result;
    }
}
