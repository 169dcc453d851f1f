// FeatureGate's attention pass on the CPU (float32): for each (batch, head) map and query row t, in one pass over the
// causal scores S[t, s] = (q_t / sqrt(D)) . k_s, s <= t, it writes
//     y_t     = sum_s P[t, s] v_s                      (the attention output)
//     lse_t   = logsumexp_s S[t, s]
// and, where the gate's statistics are asked (`ent` given; `cross` with the other block's `cq`, `ck`):
//     ent_t   = -sum_s P log P = log_z - sum_s P x     (x = S - max_s S, log_z = log sum_s exp x: no cancellation)
//     cross_t = sum_s P S'[t, s] = (q'_t / sqrt(D)) . sum_s P k'_s   (S': another block's scores)
// The output comes from the same operations with or without the statistics (the template flags only add work), and
// each map is computed by one thread alone, so the bits do not depend on the thread count.
//
// Loaded by fcaudit/models/kernel.py (built with the machine's C++ compiler on first use, -O3 -march=native, no
// fast-math). Plain C ABI so ctypes can call it: no torch headers, a one-second build.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <pthread.h>

typedef float v8 __attribute__((vector_size(32)));  // a row of v or k: head sizes are multiples of 8
#ifndef KW
#if defined(__AVX512F__)
#define KW 16  // keys per score vector: a 512-bit register where the CPU has them
#else
#define KW 8
#endif
#endif
typedef float vk __attribute__((vector_size(4 * KW)));
typedef int32_t ik __attribute__((vector_size(4 * KW)));

static const float MASKED = -1e30f;  // future keys: exp gives exactly 0 (see expk)

static inline v8 splat(float x) { return v8{} + x; }
static inline vk splatk(float x) { return vk{} + x; }
template <typename V> static inline V load(const float *p) { V r; std::memcpy(&r, p, sizeof r); return r; }
template <typename V> static inline void store(float *p, V x) { std::memcpy(p, &x, sizeof x); }
static inline v8 load8(const float *p) { return load<v8>(p); }
static inline void store8(float *p, v8 x) { store(p, x); }
template <typename V> static inline float hsum(V x) {
    float s = 0.f;
    for (unsigned i = 0; i < sizeof x / 4; i++) s += x[i];
    return s;
}
static inline float hmax(vk x) {
    float m = x[0];
    for (int i = 1; i < KW; i++) m = x[i] > m ? x[i] : m;
    return m;
}

// exp(x) for x <= 0: Cephes' expf (range reduction to [-ln2/2, ln2/2], degree-6 polynomial), within 2 ulp; inputs
// below -87.3 (P < 1e-38, and every masked key) give exactly 0, so they add nothing to any sum, P * x included.
static inline vk expk(vk x0) {
    const vk lo = splatk(-87.3f);
    vk x = x0 < lo ? lo : x0;
    vk fx = x * 1.44269504088896341f + 0.5f;
    vk fn = __builtin_convertvector(__builtin_convertvector(fx, ik), vk);
    fn = fn > fx ? fn - 1.f : fn;  // floor
    x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    vk y = splatk(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.f;
    ik e = (__builtin_convertvector(fn, ik) + 127) << 23;
    vk pow2;
    std::memcpy(&pow2, &e, sizeof pow2);
    return x0 < lo ? splatk(0.f) : y * pow2;
}

struct Strided {  // a [B, H, T, D] float32 tensor with unit stride in D
    const float *data;
    int64_t b, h, t;
    const float *map(int bi, int hi) const { return data + bi * b + hi * h; }
};

struct Job {
    int B, H, T, D;
    float scale;
    Strided q, k, v, cq, ck, y;
    float *lse, *ent, *cross;
    int n0, n1;  // maps (b * H + h) of this thread
};

static const int ROWS = 4;  // query rows whose scores are computed together (4 accumulators per key vector)

template <int D8, bool ENT, bool CROSS>
static void map_pass(const Job &j, int n, float *kt, float *s, float *vc, float *kc) {
    const int T = j.T, D = D8 * 8, Tp = (T + KW - 1) / KW * KW, bi = n / j.H, hi = n % j.H;
    const int64_t qt = j.q.t, kt_ = j.k.t, yt = j.y.t, cqt = j.cq.t;
    const float *q = j.q.map(bi, hi), *k = j.k.map(bi, hi), *cq = CROSS ? j.cq.map(bi, hi) : nullptr;
    // the rows of v and k' that every query row reads again, packed: strided rows (a projection's [B, T, 3HD]
    // output) lie a page or more apart, so reading them T times thrashes the cache and the TLB
    const float *v = vc, *ck = CROSS ? kc : nullptr;
    for (int t = 0; t < T; t++) {
        std::memcpy(vc + t * D, j.v.map(bi, hi) + t * j.v.t, sizeof(float) * D);
        if (CROSS) std::memcpy(kc + t * D, j.ck.map(bi, hi) + t * j.ck.t, sizeof(float) * D);
    }
    const int64_t vt = D, ckt = D;
    float *y = const_cast<float *>(j.y.map(bi, hi));
    float *lse = j.lse + (int64_t)n * T, *ent = ENT ? j.ent + (int64_t)n * T : nullptr;
    float *cross = CROSS ? j.cross + (int64_t)n * T : nullptr;
    const float scale = j.scale;
    for (int t = 0; t < Tp; t++)  // keys transposed [D, Tp]: scores of KW keys per vector
        for (int d = 0; d < D; d++) kt[d * Tp + t] = t < T ? k[t * kt_ + d] : 0.f;
    for (int i0 = 0; i0 < T; i0 += ROWS) {
        const int R = T - i0 < ROWS ? T - i0 : ROWS, nkv = (i0 + R + KW - 1) / KW;
        float qs[ROWS][D];
        for (int r = 0; r < ROWS; r++)
            for (int d = 0; d < D; d++) qs[r][d] = r < R ? q[(i0 + r) * qt + d] * scale : 0.f;
        for (int jb = 0; jb < nkv; jb++) {
            vk a[ROWS] = {};
            for (int d = 0; d < D; d++) {
                const vk kk = load<vk>(kt + d * Tp + jb * KW);
                for (int r = 0; r < ROWS; r++) a[r] += qs[r][d] * kk;
            }
            for (int r = 0; r < ROWS; r++) store(s + r * Tp + jb * KW, a[r]);
        }
        for (int r = 0; r < R; r++) {  // softmax of each row in place: s becomes P
            const int t = i0 + r;
            float *sr = s + r * Tp;
            for (int c = t + 1; c < nkv * KW; c++) sr[c] = MASKED;
            vk m = splatk(MASKED);
            for (int jb = 0; jb < nkv; jb++) { const vk x = load<vk>(sr + jb * KW); m = x > m ? x : m; }
            const float mx = hmax(m);
            vk z = {}, px = {};
            for (int jb = 0; jb < nkv; jb++) {
                const vk x = load<vk>(sr + jb * KW) - mx, p = expk(x);
                z += p;
                if (ENT) px += p * x;
                store(sr + jb * KW, p);
            }
            const float zs = hsum(z), log_z = std::log(zs), inv = 1.f / zs;
            lse[t] = mx + log_z;
            if (ENT) ent[t] = log_z - hsum(px) * inv;
            for (int jb = 0; jb < nkv; jb++) store(sr + jb * KW, load<vk>(sr + jb * KW) * inv);
        }
        // P V (and P K') of RB rows at a time, over keys up to the block's last row (later keys have P = 0)
        constexpr int RB = D8 <= 2 ? 4 : D8 <= 4 ? 2 : 1;
        for (int r0 = 0; r0 < R; r0 += RB) {
            const int rb = R - r0 < RB ? R - r0 : RB, last = i0 + r0 + rb - 1;
            v8 ay[RB][D8] = {}, ac[RB][D8] = {};
            for (int c = 0; c <= last; c++) {
                v8 vv[D8], kk[D8];
                for (int b = 0; b < D8; b++) {
                    vv[b] = load8(v + c * vt + b * 8);
                    if (CROSS) kk[b] = load8(ck + c * ckt + b * 8);
                }
                for (int r = 0; r < RB; r++) {
                    const v8 p = splat(s[(r0 + r) * Tp + c]);
                    for (int b = 0; b < D8; b++) {
                        ay[r][b] += p * vv[b];
                        if (CROSS) ac[r][b] += p * kk[b];
                    }
                }
            }
            for (int r = 0; r < rb; r++) {
                const int t = i0 + r0 + r;
                for (int b = 0; b < D8; b++) store8(y + t * yt + b * 8, ay[r][b]);
                if (CROSS) {
                    v8 acc = {};
                    for (int b = 0; b < D8; b++) acc += ac[r][b] * (load8(cq + t * cqt + b * 8) * splat(scale));
                    cross[t] = hsum(acc);
                }
            }
        }
    }
}

template <int D8>
static void run_maps(const Job &j, float *kt, float *s, float *vc, float *kc) {
    for (int n = j.n0; n < j.n1; n++) {
        if (j.cq.data) map_pass<D8, true, true>(j, n, kt, s, vc, kc);
        else if (j.ent) map_pass<D8, true, false>(j, n, kt, s, vc, kc);
        else map_pass<D8, false, false>(j, n, kt, s, vc, kc);
    }
}

static void *run_job(void *arg) {
    const Job &j = *static_cast<Job *>(arg);
    const int Tp = (j.T + KW - 1) / KW * KW;
    float *kt = static_cast<float *>(std::malloc(sizeof(float) * j.D * Tp));
    float *s = static_cast<float *>(std::malloc(sizeof(float) * ROWS * Tp));
    float *vc = static_cast<float *>(std::malloc(sizeof(float) * j.D * j.T));
    float *kc = static_cast<float *>(std::malloc(sizeof(float) * j.D * j.T));
    if (!kt || !s || !vc || !kc) { std::free(kt); std::free(s); std::free(vc); std::free(kc); return arg; }
    switch (j.D / 8) {
        case 1: run_maps<1>(j, kt, s, vc, kc); break;
        case 2: run_maps<2>(j, kt, s, vc, kc); break;
        case 3: run_maps<3>(j, kt, s, vc, kc); break;
        case 4: run_maps<4>(j, kt, s, vc, kc); break;
        case 5: run_maps<5>(j, kt, s, vc, kc); break;
        case 6: run_maps<6>(j, kt, s, vc, kc); break;
        case 8: run_maps<8>(j, kt, s, vc, kc); break;
        case 16: run_maps<16>(j, kt, s, vc, kc); break;
    }
    std::free(kt);
    std::free(s);
    std::free(vc);
    std::free(kc);
    return nullptr;
}

extern "C" {

// head sizes the kernel takes (D = 8 * each, zero-terminated); others stay on torch ops
extern const int fg_attend_head_blocks[16] = {1, 2, 3, 4, 5, 6, 8, 16};

// Strides are (batch, head, row) in elements; ent null: no statistics; cq / ck / cross null: no cross score (they
// need ent). Returns 0, or 1 when a
// thread could not allocate its buffers, 2 for an unsupported head size.
int fg_attend(int B, int H, int T, int D, float scale, const float *q, const int64_t *qs, const float *k,
              const int64_t *ks, const float *v, const int64_t *vs, const float *cq, const int64_t *cqs,
              const float *ck, const int64_t *cks, float *y, const int64_t *ys, float *lse, float *ent,
              float *cross, int threads) {
    bool supported = false;
    for (const int *b = fg_attend_head_blocks; *b; b++) supported |= D == 8 * *b;
    if (!supported) return 2;
    const int N = B * H;
    if (threads > N) threads = N;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    auto strided = [](const float *p, const int64_t *st) { return Strided{p, st ? st[0] : 0, st ? st[1] : 0, st ? st[2] : 0}; };
    Job jobs[64];
    pthread_t tid[64];
    bool started[64] = {};
    for (int i = 0; i < threads; i++)
        jobs[i] = Job{B, H, T, D, scale, strided(q, qs), strided(k, ks), strided(v, vs), strided(cq, cqs),
                      strided(ck, cks), strided(y, ys), lse, ent, cross, N * i / threads, N * (i + 1) / threads};
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], nullptr, run_job, &jobs[i]) == 0;
    int rc = run_job(&jobs[0]) ? 1 : 0;
    for (int i = 1; i < threads; i++) {
        if (!started[i]) { rc |= run_job(&jobs[i]) ? 1 : 0; continue; }  // no thread: run its maps here
        void *out = nullptr;
        pthread_join(tid[i], &out);
        rc |= out ? 1 : 0;
    }
    return rc;
}

}  // extern "C"
