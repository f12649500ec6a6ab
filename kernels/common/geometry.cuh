// The sequence geometry of a call: which keys each query sees, and the ranges of rows, keys and
// tiles that follow from it. Every forward and backward family asks it; none writes a mask or a
// tile-range formula of its own.
//
// FlashAttention's convention: query i is aligned with key a(i) = i + Tk - Tq (bottom right when
// Tq != Tk). It sees key j when a(i) - left <= j <= a(i) + right, where -1 leaves that side
// unbounded; causal attention is right = 0. A query that sees no key gets an output of 0 and a
// log-sum-exp of -inf. Each query's keys are one interval, and the intervals move by one key per
// query, so the keys of a block of queries are one interval too (and the queries of a block of
// keys): every range below is an interval, empty when first > last.
//
// Host and device code both include this file; it needs no CUDA header.
#ifndef GQA_COMMON_GEOMETRY_CUH
#define GQA_COMMON_GEOMETRY_CUH

#ifdef __CUDACC__
#define GQA_GEO __host__ __device__ __forceinline__
#else
#define GQA_GEO inline
#endif

struct GqaRange {
    int first, last;   // inclusive
    GQA_GEO bool empty() const { return first > last; }
    GQA_GEO int count() const { return first > last ? 0 : last - first + 1; }
    GQA_GEO bool holds(int x) const { return first <= x && x <= last; }
};

// How a block of (query, key) pairs is attended: by no pair (skip it), by every pair (no mask
// needed), or by some (mask it element by element).
enum GqaCoverage { kGqaNone = 0, kGqaPartial = 1, kGqaFull = 2 };

struct GqaGeometry {
    int Tq, Tk;
    int left, right;   // the window: -1 unbounded; causal attention has right = 0

    GQA_GEO int aligned(int i) const { return i + Tk - Tq; }

    // Query i sees key j (both inside the sequence).
    GQA_GEO bool sees(int i, int j) const {
        const int a = aligned(i);
        return i >= 0 && i < Tq && j >= 0 && j < Tk && (left < 0 || j >= a - left) && (right < 0 || j <= a + right);
    }

    // The keys that some query of [i0, i1] sees (`any`), and those that each of them sees (`all`).
    GQA_GEO GqaRange keys_any(int i0, int i1) const {
        i0 = max_of(i0, 0), i1 = min_of(i1, Tq - 1);   // the rows inside the sequence
        if (Tk == 0 || i0 > i1) return {0, -1};
        return {left < 0 ? 0 : max_of(0, aligned(i0) - left), right < 0 ? Tk - 1 : min_of(Tk - 1, aligned(i1) + right)};
    }
    GQA_GEO GqaRange keys_all(int i0, int i1) const {
        if (Tq == 0 || Tk == 0 || i0 > i1 || i0 < 0 || i1 >= Tq) return {0, -1};
        return {left < 0 ? 0 : max_of(0, aligned(i1) - left), right < 0 ? Tk - 1 : min_of(Tk - 1, aligned(i0) + right)};
    }
    // The queries that see some key of [j0, j1] (`any`), and those that see each of them (`all`):
    // the transpose, for the backward's key tiles.
    GQA_GEO GqaRange queries_any(int j0, int j1) const {
        j0 = max_of(j0, 0), j1 = min_of(j1, Tk - 1);
        if (Tq == 0 || j0 > j1) return {0, -1};
        const int shift = Tk - Tq;   // i sees j when j - right <= a(i) <= j + left
        return {right < 0 ? 0 : max_of(0, j0 - right - shift), left < 0 ? Tq - 1 : min_of(Tq - 1, j1 + left - shift)};
    }
    GQA_GEO GqaRange queries_all(int j0, int j1) const {
        if (Tq == 0 || Tk == 0 || j0 > j1 || j0 < 0 || j1 >= Tk) return {0, -1};
        const int shift = Tk - Tq;
        return {right < 0 ? 0 : max_of(0, j1 - right - shift), left < 0 ? Tq - 1 : min_of(Tq - 1, j0 + left - shift)};
    }

    // The key tiles (of `tile` keys, tile t holding keys t * tile ..) that the queries [i0, i1]
    // visit, and the query tiles that the keys [j0, j1] are visited by.
    GQA_GEO GqaRange key_tiles(int i0, int i1, int tile) const { return tiles_of(keys_any(i0, i1), tile); }
    GQA_GEO GqaRange query_tiles(int j0, int j1, int tile) const { return tiles_of(queries_any(j0, j1), tile); }

    // How the block of queries [i0, i1] against keys [j0, j1] is attended. A block that reaches
    // past Tq or Tk is never kGqaFull: its padding is masked.
    GQA_GEO GqaCoverage coverage(int i0, int i1, int j0, int j1) const {
        const GqaRange any = keys_any(i0, i1);
        if (any.empty() || any.last < j0 || any.first > j1) return kGqaNone;
        const GqaRange all = keys_all(i0, i1);
        return !all.empty() && all.first <= j0 && j1 <= all.last ? kGqaFull : kGqaPartial;
    }

  private:
    static GQA_GEO int min_of(int a, int b) { return a < b ? a : b; }
    static GQA_GEO int max_of(int a, int b) { return a > b ? a : b; }
    static GQA_GEO GqaRange tiles_of(GqaRange r, int tile) {
        return r.empty() ? GqaRange{0, -1} : GqaRange{r.first / tile, r.last / tile};
    }
};

// The geometry of FlashAttention's arguments: causal sets right to 0; a side that reaches past
// every key for every query is unbounded (-1), so that equal masks have equal geometries.
GQA_GEO GqaGeometry gqa_geometry(int Tq, int Tk, bool causal, int left, int right) {
    if (causal) right = 0;
    if (left >= Tk - 1) left = -1;     // a(i) - left <= 0 for every query: a(i) <= Tk - 1
    if (right >= Tq - 1) right = -1;   // a(i) + right >= Tk - 1 for every query: a(i) >= Tk - Tq
    return {Tq, Tk, left < 0 ? -1 : left, right < 0 ? -1 : right};
}

#undef GQA_GEO
#endif  // GQA_COMMON_GEOMETRY_CUH
