// Runs one kernel launch of kernels.cu on the CPU execution model (cuda_emu.h): reads a tape of
// (kernel, grid, block, shared bytes, arguments) written by tests/kernels_emulated.rs, launches,
// and writes every buffer argument back. Build: c++ -std=c++20 -O2 -pthread -DLOCKSTEP_EMU
// -I<gpu-engine/src/cuda> driver.cpp.
#include "cuda_emu.h"

#include "kernels.cu"

#include <cstdio>
#include <string>

namespace {

struct Arg {
    unsigned char kind;  // 0 buffer, 1 i32, 2 i64, 3 f32, 4 u64
    std::vector<unsigned char> buf;
    int32_t i32 = 0;
    int64_t i64 = 0;
    float f32 = 0;
    uint64_t u64 = 0;
};

template <class T>
bool get(FILE* f, T& v) { return fread(&v, sizeof(T), 1, f) == 1; }

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: driver TAPE OUT\n");
        return 2;
    }
    FILE* in = fopen(argv[1], "rb");
    if (!in) return 3;
    uint32_t name_len = 0;
    get(in, name_len);
    std::string name(name_len, '\0');
    if (fread(name.data(), 1, name_len, in) != name_len) return 4;
    dim3 grid, block;
    uint32_t smem = 0, nargs = 0;
    get(in, grid.x); get(in, grid.y); get(in, grid.z);
    get(in, block.x); get(in, block.y); get(in, block.z);
    get(in, smem);
    get(in, nargs);
    std::vector<Arg> a(nargs);
    for (auto& x : a) {
        get(in, x.kind);
        switch (x.kind) {
        case 0: {
            uint64_t n = 0;
            get(in, n);
            x.buf.resize(n + 16);  // slack: a 16-byte load at a buffer's end stays in bounds
            if (n && fread(x.buf.data(), 1, n, in) != n) return 5;
            x.buf.resize(n);
            break;
        }
        case 1: get(in, x.i32); break;
        case 2: get(in, x.i64); break;
        case 3: get(in, x.f32); break;
        case 4: get(in, x.u64); break;
        default: return 6;
        }
    }
    fclose(in);
    auto B = [&](int i) { return (void*)a.at(i).buf.data(); };
    auto I = [&](int i) { return a.at(i).i32; };
    auto L = [&](int i) { return a.at(i).i64; };
    auto F = [&](int i) { return a.at(i).f32; };
    using u16 = unsigned short;
    std::function<void()> body;
    if (name == "embed_gather") {
        body = [&] { embed_gather((const u16*)B(0), (const int*)B(1), (float*)B(2), I(3)); };
    } else if (name == "rms_norm") {
        body = [&] { rms_norm((const float*)B(0), (const int*)B(1), (const float*)B(2), (u16*)B(3), I(4), F(5)); };
    } else if (name == "rope_kv_write") {
        body = [&] {
            rope_kv_write((float*)B(0), (const int*)B(1), (const int*)B(2), (const int*)B(3),
                          (const int*)B(4), (const u64*)B(5), (const u64*)B(6), (const u64*)B(7),
                          (const u64*)B(8), (u32*)B(9), (u16*)B(10), I(11), I(12), I(13), I(14),
                          I(15), L(16), F(17));
        };
    } else if (name == "paged_attention_hd64" || name == "paged_attention_hd128") {
        auto k = name == "paged_attention_hd64" ? paged_attention_hd64 : paged_attention_hd128;
        body = [&, k] {
            k((const float*)B(0), (const int*)B(1), (const int*)B(2), (const int*)B(3),
              (const int*)B(4), (const u64*)B(5), (const u64*)B(6), (const u64*)B(7),
              (const u64*)B(8), (u32*)B(9), (const u16*)B(10), I(11), I(12), I(13), I(14), L(15),
              I(16), I(17), (float*)B(18), (float*)B(19));
        };
    } else if (name == "attn_reduce") {
        body = [&] { attn_reduce((const float*)B(0), (const float*)B(1), I(2), I(3), I(4), (u16*)B(5)); };
    } else if (name == "silu_mul") {
        body = [&] { silu_mul((const float*)B(0), (u16*)B(1), I(2), L(3)); };
    } else if (name == "argmax_rows") {
        body = [&] { argmax_rows((const float*)B(0), I(1), (int*)B(2)); };
    } else if (name == "xxh3_pages") {
        body = [&] { xxh3_pages((const unsigned char*)B(0), (const int*)B(1), I(2), L(3), (u64*)B(4)); };
    } else {
        fprintf(stderr, "unknown kernel %s\n", name.c_str());
        return 7;
    }
    emu_launch(grid, block, smem, body);
    FILE* out = fopen(argv[2], "wb");
    if (!out) return 8;
    for (auto& x : a) {
        if (x.kind != 0) continue;
        uint64_t n = x.buf.size();
        fwrite(&n, 8, 1, out);
        fwrite(x.buf.data(), 1, n, out);
    }
    fclose(out);
    return 0;
}
