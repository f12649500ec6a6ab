// The row-wise family (rules.cuh describes it): a unit per input dtype (GQA_DTYPE); the fp32 unit
// is compiled into the entry library (attention.cu).

#include "rowwise/rules.cuh"
#include "common/mma.cuh"

namespace {

// Walks the (row, column) items of a rows x width grid, NT items apart, from this thread's first.
template <int NT>
struct GridCursor {
    int r, c, dr, dc, width;
    __device__ __forceinline__ explicit GridCursor(const FastDiv& w) : width(w.d) {
        r = w.div(int(threadIdx.x));
        c = int(threadIdx.x) - r * width;
        dr = w.div(NT);
        dc = NT - dr * width;
    }
    __device__ __forceinline__ void next() {
        r += dr;
        c += dc;
        if (c >= width) {
            c -= width;
            ++r;
        }
    }
};

// Copies `rows` rows (pointer per row; null = past the end, zero-filled) of D elements into fp32
// shared memory with pitch ld, zero-filling columns D..D4-1. Every copy is issued before any is
// waited on: fp32 through cp.async (16 bytes when rows are 16-byte aligned), 16-bit types through
// registers, four loads per thread in flight. `width` divides by the items per row: D / 4 for
// 16-byte fp32 copies, else D4.
template <typename Elem, int NT, typename RowPtr>
__device__ __forceinline__ void rowwise_load(float* dst, int ld, RowPtr row_ptr, int rows, int D, bool vec16,
                                             bool bf16, const Elem* any_valid, const FastDiv& width) {
    const int D4 = rowwise_d4(D);
    if constexpr (std::is_same<Elem, float>::value) {
        if (vec16) {   // D is a multiple of 4 here
            for (GridCursor<NT> g(width); g.r < rows; g.next()) {
                const float* src = row_ptr(g.r);
                cp_async16(dst + g.r * ld + 4 * g.c, src != nullptr ? src + 4 * g.c : any_valid, src != nullptr ? 16 : 0);
            }
        } else {
            for (GridCursor<NT> g(width); g.r < rows; g.next()) {
                const float* src = row_ptr(g.r);
                const bool ok = src != nullptr && g.c < D;
                cp_async4(dst + g.r * ld + g.c, ok ? src + g.c : any_valid, ok ? 4 : 0);
            }
        }
    } else {
        for (GridCursor<NT> g(width); g.r < rows;) {
            Elem x[4];
            int off[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const Elem* src = g.r < rows ? row_ptr(g.r) : nullptr;
                x[u] = (src != nullptr && g.c < D) ? src[g.c] : Elem(0);
                off[u] = g.r < rows ? g.r * ld + g.c : -1;
                g.next();
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (off[u] >= 0) dst[off[u]] = to_float(x[u], bf16);
        }
    }
}

// RW dot products of q rows with each of N key rows (float4 pitch): s[n][r] = q_r . k_n. The
// columns go in blocks of kCB float4s whose shared-memory reads are all issued before the block's
// multiply-adds: a warp's chain here is latency-bound, and each block then costs one round trip.
template <int N, int RW>
__device__ __forceinline__ void rowwise_dots(const float4* const (&q4)[RW], const float4* const (&k4)[N], int n4,
                                             float (&s)[N][RW]) {
    constexpr int kCB = N * RW <= 4 ? 4 : 2;
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int r = 0; r < RW; ++r) s[n][r] = 0.f;
    for (int c0 = 0; c0 < n4; c0 += kCB) {
        float4 x[kCB][RW], y[kCB][N];
#pragma unroll
        for (int i = 0; i < kCB; ++i) {
            const int c = min(c0 + i, n4 - 1);   // past the row: read again, not used
#pragma unroll
            for (int r = 0; r < RW; ++r) x[i][r] = q4[r][c];
#pragma unroll
            for (int n = 0; n < N; ++n) y[i][n] = k4[n][c];
        }
#pragma unroll
        for (int i = 0; i < kCB; ++i) {
            if (c0 + i >= n4) break;
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    s[n][r] = fmaf(x[i][r].x, y[i][n].x, s[n][r]);
                    s[n][r] = fmaf(x[i][r].y, y[i][n].y, s[n][r]);
                    s[n][r] = fmaf(x[i][r].z, y[i][n].z, s[n][r]);
                    s[n][r] = fmaf(x[i][r].w, y[i][n].w, s[n][r]);
                }
        }
    }
}

__device__ __forceinline__ void fma4(float4& acc, float s, const float4& v) {
    acc.x = fmaf(s, v.x, acc.x);
    acc.y = fmaf(s, v.y, acc.y);
    acc.z = fmaf(s, v.z, acc.z);
    acc.w = fmaf(s, v.w, acc.w);
}

__device__ __forceinline__ void scale4(float4& acc, float s) {
    acc.x *= s;
    acc.y *= s;
    acc.z *= s;
    acc.w *= s;
}

// RW consecutive floats of shared memory, one vector load (the buffer is 4 * RW-byte aligned).
template <int RW>
__device__ __forceinline__ void load_rw(const float* src, float (&x)[RW]) {
    if constexpr (RW == 4) {
        const float4 v = *reinterpret_cast<const float4*>(src);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else if constexpr (RW == 2) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        x[0] = v.x, x[1] = v.y;
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r) x[r] = src[r];
    }
}
template <int RW>
__device__ __forceinline__ void store_rw(float* dst, const float (&x)[RW]) {
    if constexpr (RW == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
    } else if constexpr (RW == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(x[0], x[1]);
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r) dst[r] = x[r];
    }
}

// Four output columns c..c+3 of one row, scaled by inv; `vec` when D is a multiple of 4 (the
// output is contiguous, so every row starts 4-element aligned).
template <typename Elem>
__device__ __forceinline__ void rowwise_store4(Elem* dst, int c, int D, const float4& x, float inv, bool vec, bool bf16) {
    const float y0 = x.x * inv, y1 = x.y * inv, y2 = x.z * inv, y3 = x.w * inv;
    if constexpr (std::is_same<Elem, float>::value) {
        if (vec) {
            *reinterpret_cast<float4*>(dst + c) = make_float4(y0, y1, y2, y3);
            return;
        }
    } else {
        if (vec) {
            store_pair(dst + c, y0, y1, bf16);
            store_pair(dst + c + 2, y2, y3, bf16);
            return;
        }
    }
    if (c < D) dst[c] = from_float<Elem>(y0, bf16);
    if (c + 1 < D) dst[c + 1] = from_float<Elem>(y1, bf16);
    if (c + 2 < D) dst[c + 2] = from_float<Elem>(y2, bf16);
    if (c + 3 < D) dst[c + 3] = from_float<Elem>(y3, bf16);
}

template <typename Elem, int NW, int RW>
__global__ void __launch_bounds__(32 * NW)
gqa_rowwise_kernel(const GqaParams p, int kc, const RowwiseDivs dv) {
    constexpr int NT = 32 * NW, kRows = NW * RW;
    extern __shared__ float4 smem_raw[];
    const int D = p.D, G = p.group, T = p.T;
    const int D4 = rowwise_d4(D), kld = rowwise_k_pitch(D);
    float* sQ = reinterpret_cast<float*>(smem_raw);   // [kRows][kld]
    float* sK = sQ + kRows * kld;                     // [kc][kld]
    float* sV = sK + kc * kld;                        // [kc][D4]
    float* sP = sV + kc * D4;                         // [NW][kKeysPerPass][RW]: each warp's probabilities

    const bool bf16 = p.dtype == kGqaBFloat16;
    const int rows_total = T * G;
    const int n_qtiles = (rows_total + kRows - 1) / kRows;
    const int tile = dv.bh.div(int(blockIdx.x));
    const int bh = int(blockIdx.x) - tile * dv.bh.d;
    const int qtile = n_qtiles - 1 - tile;   // longest rows first
    const int b = dv.hkv.div(bh), kvh = bh - b * p.Hkv;
    const int r0 = qtile * kRows;
    const int t_hi = min(dv.group.div(r0 + kRows - 1), T - 1);

    const HeadRows<Elem> head(p, b, kvh);
    const Elem *q_base = head.q, *k_base = head.k, *v_base = head.v;
    auto q_row = [&](int r) { return head.q_row(p, dv.group, r0 + r, rows_total); };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int Rw = r0 + warp * RW;   // the warp's first packed row
    int tr[RW];                      // each row's time step; -1: a padding row, attends to nothing
    const float4* q4[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        tr[r] = Rw + r < rows_total ? dv.group.div(Rw + r) : -1;
        q4[r] = reinterpret_cast<const float4*>(sQ + (warp * RW + r) * kld);
    }
    // Rows are in time order and padding rows come last: the first row attends the fewest keys.
    int t_top = tr[0];
#pragma unroll
    for (int r = 1; r < RW; ++r) t_top = max(t_top, tr[r]);
    float* pw = sP + warp * (kRowKeysPerPass * RW);

    // P V layout: lane = kq * cgp + cg. The lane owns columns 4cg..4cg+3 (and 128 further on when
    // D4 > 128) and keys j = kq (mod ks); cgp is the column-group count rounded up to a power of two.
    const int n4 = D4 / 4;
    const int lg = n4 >= 32 ? 5 : 32 - __clz(n4 - 1);   // log2(cgp)
    const int cgp = 1 << lg;
    const int ks = 32 >> lg;
    int kq = lane >> lg, cg = lane & (cgp - 1);
    const bool has0 = cg < n4, has1 = cg + 32 < n4;
    // The warp's rows and lane layout, like the copy plan below, are computed before the wait
    // (asm barriers keep the compiler from moving them after it).
#pragma unroll
    for (int r = 0; r < RW; ++r) asm volatile("" : "+r"(tr[r]));
    asm volatile("" : "+r"(t_top), "+r"(kq), "+r"(cg));
    // Planned path: every 16-byte copy of this thread (q rows, then K rows, then V rows of the
    // one chunk) is addressed before the wait for the previous grid, so after it only the copy
    // instructions remain (the address arithmetic of the copy loops was most of the load phase:
    // bench/NOTES.md).
    const bool planned = std::is_same<Elem, float>::value && dv.planned;   // uniform; host-checked
    constexpr int kPlan = rowwise_planned_copies(RW) > 0 ? rowwise_planned_copies(RW) : 1;
    const float* plan_src[kPlan];
    uint32_t plan_dst[kPlan];
    int plan_bytes[kPlan];
    if (planned) {
        const int w = dv.width.d, nk0 = t_hi + 1, n_q = kRows * w, n_k = nk0 * w;
        const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(sQ));
#pragma unroll
        for (int u = 0; u < kPlan; ++u) {
            int i = int(threadIdx.x) + u * NT;
            const Elem* s = nullptr;
            int off = -1;
            if (i < n_q) {
                const int r = dv.width.div(i), c = i - r * w;
                s = q_row(r);
                s = s != nullptr ? s + 4 * c : nullptr;
                off = r * kld + 4 * c;
            } else if ((i -= n_q) < n_k) {
                const int r = dv.width.div(i), c = i - r * w;
                s = k_base + int64_t(r) * p.k_stride_t + 4 * c, off = int(sK - sQ) + r * kld + 4 * c;
            } else if ((i -= n_k) < n_k) {
                const int r = dv.width.div(i), c = i - r * w;
                s = v_base + int64_t(r) * p.v_stride_t + 4 * c, off = int(sV - sQ) + r * D4 + 4 * c;
            }
            plan_bytes[u] = off < 0 ? -1 : s != nullptr ? 16 : 0;   // -1: no copy; 0: zero-fill
            plan_src[u] = reinterpret_cast<const float*>(s != nullptr ? s : q_base);
            plan_dst[u] = s_q + 4u * uint32_t(max(off, 0));
            asm volatile("" : "+l"(plan_src[u]), "+r"(plan_dst[u]), "+r"(plan_bytes[u]));   // here, before the wait
        }
    }
    grid_dependency_wait();   // q, k and v may come from the kernel before this one
    allow_dependent_launch();
    if (planned) {
#pragma unroll
        for (int u = 0; u < kPlan; ++u) {
            if (plan_bytes[u] >= 0) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(plan_dst[u]), "l"(plan_src[u]), "r"(plan_bytes[u]));
            }
        }
    } else {
        rowwise_load<Elem, NT>(sQ, kld, q_row, kRows, D, p.vec16, bf16, q_base, dv.width);   // waited on with chunk 0
    }

    float4 acc0[RW], acc1[RW];
    float m[RW], l[RW];   // running max (log2 units, warp-uniform); this lane's share of the sum
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        acc0[r] = acc1[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }

    for (int c0 = 0; c0 <= t_hi; c0 += kc) {
        const int nk = min(kc, t_hi + 1 - c0);
        if (c0 > 0) __syncthreads();   // every warp is done with the previous chunk
        auto k_row = [&](int r) -> const Elem* { return k_base + int64_t(c0 + r) * p.k_stride_t; };
        auto v_row = [&](int r) -> const Elem* { return v_base + int64_t(c0 + r) * p.v_stride_t; };
        if (!planned) {   // the planned path's one chunk is already in flight
            rowwise_load<Elem, NT>(sK, kld, k_row, nk, D, p.vec16, bf16, k_base, dv.width);
            rowwise_load<Elem, NT>(sV, D4, v_row, nk, D, p.vec16, bf16, v_base, dv.width);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        const int n_hi = min(nk, t_top + 1 - c0);     // keys of this chunk some row attends
        const int n_lo = max(min(nk, tr[0] + 1 - c0), 0);   // ... and every row attends
        for (int kb = 0; kb < n_hi; kb += kRowKeysPerPass) {
            const int nb = min(n_hi - kb, kRowKeysPerPass), nb_lo = min(max(n_lo - kb, 0), nb);
            // 1. Scores of this pass's keys for every row, one max per row, probabilities.
            auto softmax_pass = [&](auto n_const) {
                constexpr int N = decltype(n_const)::value;
                const float4* k4[N];
#pragma unroll
                for (int n = 0; n < N; ++n) k4[n] = reinterpret_cast<const float4*>(sK + (kb + min(lane + 32 * n, nb - 1)) * kld);
                float s[N][RW], mx[RW];
                rowwise_dots<N, RW>(q4, k4, n4, s);
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    mx[r] = -INFINITY;
#pragma unroll
                    for (int n = 0; n < N; ++n) {
                        const int j = c0 + kb + lane + 32 * n;   // absolute key index
                        s[n][r] = j <= tr[r] ? s[n][r] * p.scale_log2 : -INFINITY;
                        mx[r] = fmaxf(mx[r], s[n][r]);
                    }
                }
#pragma unroll
                for (int r = 0; r < RW; ++r) {
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], o));
                    const float m_new = fmaxf(m[r], mx[r]);
                    const float m_ref = m_new == -INFINITY ? 0.f : m_new;   // nothing attended yet
                    const float alpha = fast_exp2(m[r] - m_ref);
                    m[r] = m_new;
                    l[r] *= alpha;
                    scale4(acc0[r], alpha);
                    if (n4 > 32) scale4(acc1[r], alpha);   // a second column group only past head_dim 128
#pragma unroll
                    for (int n = 0; n < N; ++n) {
                        s[n][r] = fast_exp2(s[n][r] - m_ref);
                        l[r] += s[n][r];
                    }
                }
#pragma unroll
                for (int n = 0; n < N; ++n)
                    if (lane + 32 * n < nb) store_rw<RW>(pw + (lane + 32 * n) * RW, s[n]);
            };
            if (nb > 96) softmax_pass(std::integral_constant<int, 4>());
            else if (nb > 64) softmax_pass(std::integral_constant<int, 3>());
            else if (nb > 32) softmax_pass(std::integral_constant<int, 2>());
            else softmax_pass(std::integral_constant<int, 1>());
            __syncwarp();
            // 2. P V: this lane's keys into this lane's columns, every row at once for the keys
            // every row attends, then row by row for the rest.
            const float* vc = sV + kb * D4 + 4 * cg;
            auto attends = [&](int j, int r) { return c0 + kb + j <= tr[r]; };
            if (n4 <= 32) {
                if (has0) {
                    // Keys in blocks of kKB, all of a block's reads first (one round trip each).
                    constexpr int kKB = RW <= 2 ? 8 : 4;
                    int j = kq;
                    for (; j + (kKB - 1) * ks < nb_lo; j += kKB * ks) {
                        float pr[kKB][RW];
                        float4 v[kKB];
#pragma unroll
                        for (int u = 0; u < kKB; ++u) {
                            load_rw<RW>(pw + (j + u * ks) * RW, pr[u]);
                            v[u] = *reinterpret_cast<const float4*>(vc + (j + u * ks) * D4);
                        }
#pragma unroll
                        for (int u = 0; u < kKB; ++u)
#pragma unroll
                            for (int r = 0; r < RW; ++r) fma4(acc0[r], pr[u][r], v[u]);
                    }
                    for (; j < nb_lo; j += ks) {
                        float pr[RW];
                        load_rw<RW>(pw + j * RW, pr);
                        const float4 v = *reinterpret_cast<const float4*>(vc + j * D4);
#pragma unroll
                        for (int r = 0; r < RW; ++r) fma4(acc0[r], pr[r], v);
                    }
                    for (; j < nb; j += ks) {
                        float pr[RW];
                        load_rw<RW>(pw + j * RW, pr);
                        const float4 v = *reinterpret_cast<const float4*>(vc + j * D4);
#pragma unroll
                        for (int r = 0; r < RW; ++r)
                            if (attends(j, r)) fma4(acc0[r], pr[r], v);
                    }
                }
            } else {   // D4 > 128: every lane has a first column group, some a second; ks = 1
                for (int j = 0; j < nb; ++j) {
                    float pr[RW];
                    load_rw<RW>(pw + j * RW, pr);
                    const float4 v0 = *reinterpret_cast<const float4*>(vc + j * D4);
                    const float4 v1 = has1 ? *reinterpret_cast<const float4*>(vc + j * D4 + 128) : v0;
                    const bool all = j < nb_lo;
#pragma unroll
                    for (int r = 0; r < RW; ++r) {
                        if (all || attends(j, r)) {
                            fma4(acc0[r], pr[r], v0);
                            fma4(acc1[r], pr[r], v1);
                        }
                    }
                }
            }
            __syncwarp();   // pw is rewritten by the next pass
        }
    }

    // Lanes that share columns hold sums over disjoint keys.
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        for (int o = cgp; o < 32; o <<= 1) {
            acc0[r].x += __shfl_xor_sync(0xffffffffu, acc0[r].x, o);
            acc0[r].y += __shfl_xor_sync(0xffffffffu, acc0[r].y, o);
            acc0[r].z += __shfl_xor_sync(0xffffffffu, acc0[r].z, o);
            acc0[r].w += __shfl_xor_sync(0xffffffffu, acc0[r].w, o);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
    }
    if (!has0) return;
    const bool vec = (D & 3) == 0;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        // Row r is stored by the lanes whose key slice is r (mod ks): RW / ks rows per lane at most.
        if (tr[r] < 0 || (r & (ks - 1)) != kq) continue;
        const int t = tr[r], R = Rw + r;
        const float inv = 1.f / l[r];
        Elem* dst = static_cast<Elem*>(p.o) + b * p.o_stride_b + int64_t(t) * p.o_stride_t +
                    int64_t(kvh * G + (R - t * G)) * p.o_stride_h;
        rowwise_store4(dst, 4 * cg, D, acc0[r], inv, vec, bf16);
        if (has1) rowwise_store4(dst, 4 * cg + 128, D, acc1[r], inv, vec, bf16);
    }
}

template <typename Elem, int NW, int RW>
cudaError_t launch_rowwise(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    static bool raised[kMaxDevices] = {};
    const int kc = rowwise_chunk_keys(p, NW, RW);
    if (kc < 32) return cudaErrorInvalidConfiguration;   // not one warp of keys fits
    const size_t smem = sizeof(float) * (size_t(rowwise_fixed_floats(p.D, NW, RW)) + size_t(kc) * rowwise_key_floats(p.D));
    auto kernel = gqa_rowwise_kernel<Elem, NW, RW>;
    cudaError_t err = raise_smem_limit(kernel, kRowSmemBudget, dev, raised);
    if (err != cudaSuccess) return err;
    RowwiseDivs dv;
    dv.bh = FastDiv(p.B * p.Hkv);
    dv.hkv = FastDiv(p.Hkv);
    dv.group = FastDiv(p.group);
    dv.width = FastDiv(std::is_same<Elem, float>::value && p.vec16 ? p.D / 4 : rowwise_d4(p.D));
    dv.planned = plan.planned;
    return launch_overlapped(kernel, packed_row_ctas(p, NW * RW), 32 * NW, smem, stream, dev, p, kc, dv);
}

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): both CTA shapes, one input dtype.
cudaError_t rowwise_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
    using Elem = ElemOf<GQA_DTYPE>;
    return plan.warps == 8 ? launch_rowwise<Elem, 8, 1>(p, plan, s, dev)
                            : launch_rowwise<Elem, 4, 4>(p, plan, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(rowwise)
