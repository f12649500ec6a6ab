// Layout probe for the wgmma (sm_90a) attention tile of kernels/attention.cu, one tile, no torch:
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o probe bench/wgmma_layout_probe.cu && ./probe
//   S = Q K^T  (m64n64k16, Q and K K-major in 128-byte-swizzled shared memory)
//   O = P V    (m64nDk16, P from registers, V N-major (rows = keys) in swizzled shared memory, trans-b)
// Tries candidate (LBO, SBO) encodings for V and reports the error of each against a host product.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>

// wgmma wrappers (m64nNk16, f32 accumulators) for this probe.
template <bool kBf16> __device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    if constexpr (kBf16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "l"(da), "l"(db), "r"(scale_d));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "l"(da), "l"(db), "r"(scale_d));
    }
}
template <bool kBf16> __device__ __forceinline__ void wgmma_rs_n64_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    if constexpr (kBf16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
}
template <bool kBf16> __device__ __forceinline__ void wgmma_rs_n128_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    if constexpr (kBf16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// Byte offset of element (r, c) of a [rows][cols] bf16 tile stored as 64-column blocks of
// [rows][128 B], 16-byte chunks XOR-swizzled by (r % 8).
__host__ __device__ inline uint32_t sw128_offset(int r, int c, int rows) {
    const int blk = c / 64, cc = c % 64;
    const int chunk = (cc * 2) / 16, within = (cc * 2) % 16;
    return uint32_t(blk * rows * 128 + r * 128 + ((chunk ^ (r % 8)) * 16) + within);
}
__device__ inline uint64_t desc_encode(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
           (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ inline void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ inline void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ inline void fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int D>
__global__ void __launch_bounds__(128) unit(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                            float* s_out, __nv_bfloat16* p_out, float* o_out, uint32_t v_lbo, uint32_t v_sbo) {
    constexpr int R = 64;   // query rows, keys
    extern __shared__ __align__(1024) unsigned char sm[];
    unsigned char* sQ = sm;
    unsigned char* sK = sQ + R * D * 2;
    unsigned char* sV = sK + R * D * 2;
    for (int i = threadIdx.x; i < R * D; i += 128) {
        const int r = i / D, c = i % D;
        *reinterpret_cast<__nv_bfloat16*>(sQ + sw128_offset(r, c, R)) = q[i];
        *reinterpret_cast<__nv_bfloat16*>(sK + sw128_offset(r, c, R)) = k[i];
        *reinterpret_cast<__nv_bfloat16*>(sV + sw128_offset(r, c, R)) = v[i];
    }
    fence_proxy();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, tig = lane & 3;
    float s[32];
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk / 4) * R * 128 + (kk % 4) * 32;
        wgmma_ss_n64<true>(s, desc_encode(smem_u32(sQ) + off, 16, 1024), desc_encode(smem_u32(sK) + off, 16, 1024), 1);
    }
    wg_commit();
    wg_wait0();
    // S out, and P = bf16(S / 16) as A fragments.
    uint32_t a[4][4];   // 4 k-steps of 16 keys
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + gid + 8 * (e >> 1), col = 8 * j + 2 * tig + (e & 1);
            s_out[row * R + col] = s[4 * j + e];
            p_out[row * R + col] = __float2bfloat16_rn(s[4 * j + e] / 16.f);
        }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * ks + h;
            const __nv_bfloat162 lo = __floats2bfloat162_rn(s[4 * j] / 16.f, s[4 * j + 1] / 16.f);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(s[4 * j + 2] / 16.f, s[4 * j + 3] / 16.f);
            a[ks][2 * h] = *reinterpret_cast<const uint32_t*>(&lo);
            a[ks][2 * h + 1] = *reinterpret_cast<const uint32_t*>(&hi);
        }
    float o[D / 2];
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const uint64_t db = desc_encode(smem_u32(sV) + ks * 16 * 128, v_lbo, v_sbo);
        if constexpr (D == 64) wgmma_rs_n64_tb<true>(*reinterpret_cast<float(*)[32]>(o), a[ks], db, 1);
        else wgmma_rs_n128_tb<true>(*reinterpret_cast<float(*)[64]>(o), a[ks], db, 1);
    }
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + gid + 8 * (e >> 1), col = 8 * j + 2 * tig + (e & 1);
            o_out[row * D + col] = o[4 * j + e];
        }
}

static float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

template <int D> int run() {
    constexpr int R = 64;
    std::vector<__nv_bfloat16> hq(R * D), hk(R * D), hv(R * D);
    uint32_t st = 12345u;
    auto rnd = [&] { st = st * 1664525u + 1013904223u; return float((st >> 8) & 0xffff) / 65536.f - 0.5f; };
    for (int i = 0; i < R * D; ++i) { hq[i] = __float2bfloat16_rn(rnd() * 2); hk[i] = __float2bfloat16_rn(rnd() * 2); hv[i] = __float2bfloat16_rn(rnd() * 2); }
    __nv_bfloat16 *q, *k, *v, *p; float *s, *o;
    cudaMalloc(&q, R * D * 2); cudaMalloc(&k, R * D * 2); cudaMalloc(&v, R * D * 2); cudaMalloc(&p, R * R * 2);
    cudaMalloc(&s, R * R * 4); cudaMalloc(&o, R * D * 4);
    cudaMemcpy(q, hq.data(), R * D * 2, cudaMemcpyHostToDevice); cudaMemcpy(k, hk.data(), R * D * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(v, hv.data(), R * D * 2, cudaMemcpyHostToDevice);
    const int smem = 3 * R * D * 2 + 1024;
    cudaFuncSetAttribute(unit<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    // S check (does not depend on the V encoding).
    const uint32_t cands[][2] = {{uint32_t(R * 128), 1024}, {1024, uint32_t(R * 128)}, {16, 1024}, {uint32_t(R * 128), 16}};
    int best = -1;
    for (int ci = 0; ci < 4; ++ci) {
        cudaMemset(o, 0xff, R * D * 4);
        unit<D><<<1, 128, smem>>>(q, k, v, s, p, o, cands[ci][0], cands[ci][1]);
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) { printf("D=%d cand %d: %s\n", D, ci, cudaGetErrorString(e)); return 1; }
        std::vector<float> hs(R * R), ho(R * D); std::vector<__nv_bfloat16> hp(R * R);
        cudaMemcpy(hs.data(), s, R * R * 4, cudaMemcpyDeviceToHost); cudaMemcpy(ho.data(), o, R * D * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(hp.data(), p, R * R * 2, cudaMemcpyDeviceToHost);
        double es = 0, eo = 0;
        for (int r = 0; r < R; ++r) for (int c = 0; c < R; ++c) {
            double ref = 0; for (int d = 0; d < D; ++d) ref += double(__bfloat162float(hq[r * D + d])) * __bfloat162float(hk[c * D + d]);
            es = fmax(es, fabs(ref - hs[r * R + c]));
        }
        for (int r = 0; r < R; ++r) for (int d = 0; d < D; ++d) {
            double ref = 0; for (int c = 0; c < R; ++c) ref += double(__bfloat162float(hp[r * R + c])) * __bfloat162float(hv[c * D + d]);
            const double got = ho[r * D + d];
            eo = (got == got) ? fmax(eo, fabs(ref - got)) : 1e30;
        }
        printf("D=%d V (LBO=%u, SBO=%u): S max err %.3g, O max err %.3g%s\n", D, cands[ci][0], cands[ci][1], es, eo,
               es < 1e-2 && eo < 1e-2 ? "  OK" : "");
        if (es < 1e-2 && eo < 1e-2 && best < 0) best = ci;
    }
    printf("D=%d: %s\n", D, best >= 0 ? "a V encoding matches" : "NO V ENCODING MATCHES");
    (void)bf;
    return best >= 0 ? 0 : 1;
}

int main() { return run<64>() | run<128>(); }
