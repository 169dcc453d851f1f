// FeatureGate's attention pass on the CPU (float32): for each (batch, head) map and query row t, in one pass over the
// causal scores S[t, s] = (q_t / sqrt(D)) . k_s, s <= t, it writes
//     y_t     = sum_s P[t, s] v_s                      (the attention output)
//     lse_t   = logsumexp_s S[t, s]
// and, where the gate's statistics are asked (`ent` given; `cross` with the other block's `cq`, `ck`):
//     ent_t   = -sum_s P log P = log_z - sum_s P x     (x = S - max_s S, log_z = log sum_s exp x: no cancellation)
//     cross_t = sum_s P S'[t, s] = (q'_t / sqrt(D)) . sum_s P k'_s   (S': another block's scores)
// Every vector holds one value for each of KW query rows (a block of rows), so scores, softmax and the weighted sums
// over keys are all lane-wise and each row of k, v, k' is read once per block. The output comes from the same
// operations with or without the statistics (the template flags only add work), and each map is computed by one
// thread alone, so the bits do not depend on the thread count.
//
// Loaded by fcaudit/models/kernel.py (built with the machine's C++ compiler on first use, -O3 -march=native, no
// fast-math). Plain C ABI so ctypes can call it: no torch headers, a one-second build.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef KW
#if defined(__AVX512F__)
#define KW 16  // query rows per vector: a 512-bit register where the CPU has them
#else
#define KW 8
#endif
#endif
typedef float vk __attribute__((vector_size(4 * KW)));
typedef int32_t ik __attribute__((vector_size(4 * KW)));
static const int CHUNK = KW == 16 ? 24 : 8;  // head columns accumulated at a time (registers: 32 zmm, 16 ymm)

static const float MASKED = -1e30f;  // future keys: exp gives exactly 0 (see expk)

static inline vk splat(float x) { return vk{} + x; }
static inline vk load(const float *p) { vk r; std::memcpy(&r, p, sizeof r); return r; }
static inline void store(float *p, vk x) { std::memcpy(p, &x, sizeof x); }

// exp(x) for x <= 0: Cephes' expf (range reduction to [-ln2/2, ln2/2], degree-6 polynomial), within 2 ulp; inputs
// below -87.3 (P < 1e-38, and every masked key) give exactly 0, so they add nothing to any sum, P * x included.
static inline vk expk(vk x0) {
    const vk lo = splat(-87.3f);
    vk x = x0 < lo ? lo : x0;
    vk fx = x * 1.44269504088896341f + 0.5f;
    vk fn = __builtin_convertvector(__builtin_convertvector(fx, ik), vk);
    fn = fn > fx ? fn - 1.f : fn;  // floor
    x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    vk y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.f;
    ik e = (__builtin_convertvector(fn, ik) + 127) << 23;
    vk pow2;
    std::memcpy(&pow2, &e, sizeof pow2);
    return x0 < lo ? splat(0.f) : y * pow2;
}

struct Strided {  // a [B, H, T, D] float32 tensor with unit stride in D
    const float *data;
    int64_t b, h, t;
    const float *map(int bi, int hi) const { return data + bi * b + hi * h; }
};

struct Job {
    int H, T, D;
    float scale;
    Strided q, k, v, cq, ck, y;
    float *lse, *ent, *cross;
};

struct Buffers {  // one thread's: rows of k, v, k' packed [T, D]; a block's q, q' transposed [D, KW]; P [T, KW]
    float *k, *v, *ck, *qt, *cqt, *p;
};

// a map's rows [T, D] packed: strided rows (a projection's [B, T, 3HD] output) lie a page or more apart
static void pack(float *dst, const Strided &x, int bi, int hi, int T, int D) {
    const float *src = x.map(bi, hi);
    for (int t = 0; t < T; t++) std::memcpy(dst + (int64_t)t * D, src + t * x.t, sizeof(float) * D);
}

// rows i0 .. i0 + KW of x times `scale`, transposed [D, KW] (0 past row T)
static void transpose_rows(float *dst, const Strided &x, int bi, int hi, int i0, int R, int D, float scale) {
    const float *src = x.map(bi, hi);
    for (int d = 0; d < D; d++)
        for (int r = 0; r < KW; r++) dst[d * KW + r] = r < R ? src[(i0 + r) * x.t + d] * scale : 0.f;
}

// acc[i] = sum_c P[c] rows[c, d0 + i] for DC columns: lane r of acc is query row i0 + r
template <int DC>
static inline void weigh(const float *rows, int D, int d0, const float *p, int keys, vk *acc) {
    vk a[DC] = {};
    for (int c = 0; c < keys; c++) {
        const vk pc = load(p + c * KW);
        const float *row = rows + (int64_t)c * D + d0;
        for (int i = 0; i < DC; i++) a[i] += pc * row[i];
    }
    for (int i = 0; i < DC; i++) acc[i] = a[i];
}

static inline int weigh_chunk(const float *rows, int D, int d0, const float *p, int keys, vk *acc) {
    const int left = D - d0;
    if (CHUNK >= 24 && left >= 24) { weigh<24>(rows, D, d0, p, keys, acc); return 24; }
    if (CHUNK >= 16 && left >= 16) { weigh<16>(rows, D, d0, p, keys, acc); return 16; }
    weigh<8>(rows, D, d0, p, keys, acc);
    return 8;
}

template <bool ENT, bool CROSS>
static void map_pass(const Job &j, int n, const Buffers &b) {
    const int T = j.T, D = j.D, bi = n / j.H, hi = n % j.H;
    pack(b.k, j.k, bi, hi, T, D);
    pack(b.v, j.v, bi, hi, T, D);
    if (CROSS) pack(b.ck, j.ck, bi, hi, T, D);
    float *y = const_cast<float *>(j.y.map(bi, hi)), *lse = j.lse + (int64_t)n * T;
    vk lane;
    for (int r = 0; r < KW; r++) lane[r] = (float)r;
    vk acc[CHUNK];
    for (int i0 = 0; i0 < T; i0 += KW) {
        const int R = T - i0 < KW ? T - i0 : KW, keys = i0 + R;
        transpose_rows(b.qt, j.q, bi, hi, i0, R, D, j.scale);
        // scores of 4 keys at a time: lane r of p[c] is S[i0 + r, c]
        int c = 0;
        for (; c + 4 <= keys; c += 4) {
            vk a0 = {}, a1 = {}, a2 = {}, a3 = {};
            const float *k0 = b.k + (int64_t)c * D;
            for (int d = 0; d < D; d++) {
                const vk qd = load(b.qt + d * KW);
                a0 += qd * k0[d]; a1 += qd * k0[D + d]; a2 += qd * k0[2 * D + d]; a3 += qd * k0[3 * D + d];
            }
            store(b.p + c * KW, a0); store(b.p + (c + 1) * KW, a1);
            store(b.p + (c + 2) * KW, a2); store(b.p + (c + 3) * KW, a3);
        }
        for (; c < keys; c++) {
            vk a0 = {};
            const float *k0 = b.k + (int64_t)c * D;
            for (int d = 0; d < D; d++) a0 += load(b.qt + d * KW) * k0[d];
            store(b.p + c * KW, a0);
        }
        // softmax over keys, lane-wise; keys past a row's own (c > i0 + r) are masked
        const vk row = lane + (float)i0;
        vk m = splat(MASKED);
        for (c = 0; c < keys; c++) {
            vk x = load(b.p + c * KW);
            if (c > i0) { x = row < (float)c ? splat(MASKED) : x; store(b.p + c * KW, x); }
            m = x > m ? x : m;
        }
        vk z = {}, px = {};
        for (c = 0; c < keys; c++) {
            const vk x = load(b.p + c * KW) - m, p = expk(x);
            z += p;
            if (ENT) px += p * x;
            store(b.p + c * KW, p);  // unnormalized: the sums below are divided by z once
        }
        const vk inv = 1.f / z;
        for (int r = 0; r < R; r++) {
            const float log_z = std::log(z[r]);
            lse[i0 + r] = m[r] + log_z;
            if (ENT) j.ent[(int64_t)n * T + i0 + r] = log_z - px[r] * inv[r];
        }
        for (int d0 = 0; d0 < D;) {
            const int dc = weigh_chunk(b.v, D, d0, b.p, keys, acc);
            for (int i = 0; i < dc; i++) {
                const vk out = acc[i] * inv;
                for (int r = 0; r < R; r++) y[(i0 + r) * j.y.t + d0 + i] = out[r];
            }
            d0 += dc;
        }
        if (CROSS) {  // q'_t . (P K')_t
            transpose_rows(b.cqt, j.cq, bi, hi, i0, R, D, j.scale);
            vk cross = {};
            for (int d0 = 0; d0 < D;) {
                const int dc = weigh_chunk(b.ck, D, d0, b.p, keys, acc);
                for (int i = 0; i < dc; i++) cross += acc[i] * load(b.cqt + (d0 + i) * KW);
                d0 += dc;
            }
            cross *= inv;
            for (int r = 0; r < R; r++) j.cross[(int64_t)n * T + i0 + r] = cross[r];
        }
    }
}

// the maps [n0, n1) with this thread's buffers; false where they could not be allocated
static bool run_maps(const Job &j, int n0, int n1) {
    const size_t rows = sizeof(float) * j.T * j.D, block = sizeof(float) * j.D * KW;
    Buffers b{static_cast<float *>(std::malloc(rows)), static_cast<float *>(std::malloc(rows)),
              static_cast<float *>(std::malloc(rows)), static_cast<float *>(std::malloc(block)),
              static_cast<float *>(std::malloc(block)),
              static_cast<float *>(std::malloc(sizeof(float) * (j.T + KW) * KW))};
    const bool ok = b.k && b.v && b.ck && b.qt && b.cqt && b.p;
    for (int n = n0; ok && n < n1; n++) {
        if (j.cq.data) map_pass<true, true>(j, n, b);
        else if (j.ent) map_pass<true, false>(j, n, b);
        else map_pass<false, false>(j, n, b);
    }
    for (float *p : {b.k, b.v, b.ck, b.qt, b.cqt, b.p}) std::free(p);
    return ok;
}

extern "C" {

// Strides are (batch, head, row) in elements; ent null: no statistics; cq / ck / cross null: no cross score (they
// need ent). Returns 0, or 1 when a thread could not allocate its buffers, 2 for a head size that is no multiple of 8.
int fg_attend(int B, int H, int T, int D, float scale, const float *q, const int64_t *qs, const float *k,
              const int64_t *ks, const float *v, const int64_t *vs, const float *cq, const int64_t *cqs,
              const float *ck, const int64_t *cks, float *y, const int64_t *ys, float *lse, float *ent,
              float *cross, int threads) {
    if (D % 8 || D < 8) return 2;
    const int N = B * H;
    if (threads > N) threads = N;
    if (threads < 1) threads = 1;
    auto strided = [](const float *p, const int64_t *st) {
        return Strided{p, st ? st[0] : 0, st ? st[1] : 0, st ? st[2] : 0};
    };
    const Job job{H, T, D, scale, strided(q, qs), strided(k, ks), strided(v, vs), strided(cq, cqs),
                  strided(ck, cks), strided(y, ys), lse, ent, cross};
    int rc = 0;
    // torch's own OpenMP runtime where the build links it (the same libgomp.so.1 torch loaded): its pool, not
    // threads of our own that would compete with torch's spinning workers for the cores
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
#ifdef _OPENMP
        const int i = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int i = 0, n = 1;
#endif
        rc |= run_maps(job, (int)((int64_t)N * i / n), (int)((int64_t)N * (i + 1) / n)) ? 0 : 1;
    }
    return rc;
}

}  // extern "C"
