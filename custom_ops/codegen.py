"""Lowering: a `LibrarySpec` to C source for its target (AVX-512, AVX2/FMA, NEON, or portable scalar C).

The source holds, for every micro-kernel of the spec, a register-blocked kernel whose accumulators are named
variables (an array would be spilled) and its twin that reads B in place through a row-offset table, the
packing routines, a blocked GEMM with a fused epilogue, and three convolutions: a GEMM that packs its im2col
panels straight from the image, an implicit GEMM that reads them in place from the image's zero-padded planes
split by stride phase (so every tap reads a unit-stride run), and a direct one over the same planes for
depthwise-like shapes; then a bias+residual+clamp kernel and a naive GEMM for comparison. Epilogues add a
residual the output already holds before the clamp. Work is split over a persistent pool of POSIX threads,
and each thread keeps its working buffers between calls. Every exported function checks its arguments and
returns a nonzero code instead of touching memory it was not given.
"""

from __future__ import annotations

from .spec import LibrarySpec, MicroKernel, Target, check_library

VECTOR_MACROS = {
    "x86-64-avx512": """
typedef __m512 vf;
#define LANES 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VLOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define VSTOREN(p, v, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), v)
#define VEVEN(lo, hi) _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi)
#define VODD(lo, hi) _mm512_permutex2var_ps(lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi)
""",
    "x86-64-avx2": """
typedef __m256 vf;
#define LANES 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define LANE_MASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VLOADN(p, n) _mm256_maskload_ps(p, LANE_MASK(n))
#define VSTOREN(p, v, n) _mm256_maskstore_ps(p, LANE_MASK(n), v)
#define VPICK(lo, hi, sel) _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, sel)), 0xD8))
#define VEVEN(lo, hi) VPICK(lo, hi, 0x88)
#define VODD(lo, hi) VPICK(lo, hi, 0xDD)
""",
    "aarch64-neon": """
typedef float32x4_t vf;
#define LANES 4
#define VZERO() vdupq_n_f32(0.0f)
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, v) vst1q_f32(p, v)
#define VSET1(x) vdupq_n_f32(x)
#define VBCAST(p) vld1q_dup_f32(p)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VADD(a, b) vaddq_f32(a, b)
#define VMUL(a, b) vmulq_f32(a, b)
#define VMAX(a, b) vbslq_f32(vcgtq_f32(a, b), a, b)  /* as x86's max_ps: b when either is NaN, or both zero */
#define VMIN(a, b) vbslq_f32(vcltq_f32(a, b), a, b)
static inline vf VLOADN(const float *p, long n) { float t[4] = {0}; memcpy(t, p, sizeof(float) * n); return vld1q_f32(t); }
static inline void VSTOREN(float *p, vf v, long n) { float t[4]; vst1q_f32(t, v); memcpy(p, t, sizeof(float) * n); }
#define VEVEN(lo, hi) vuzp1q_f32(lo, hi)
#define VODD(lo, hi) vuzp2q_f32(lo, hi)
""",
    "scalar": """
typedef float vf;
#define LANES 1
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VBCAST(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VADD(a, b) ((a) + (b))
#define VMUL(a, b) ((a) * (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#define VMIN(a, b) ((a) < (b) ? (a) : (b))
#define VLOADN(p, n) ((n) > 0 ? *(p) : 0.0f)
#define VSTOREN(p, v, n) do { if ((n) > 0) *(p) = (v); } while (0)
#define VEVEN(lo, hi) (lo)
#define VODD(lo, hi) (hi)
""",
}

PRELUDE = r"""
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef ptrdiff_t idx;
typedef struct { float alpha; idx brs, bcs; int clamp; float lo, hi; } epi_t;
typedef void (*micro_fn)(idx, const float *, const float *, float *, idx, int, int, int, int, const epi_t *,
                         const float *);
typedef void (*accum_fn)(idx, const float *, const float *, const idx *, float *);
typedef struct { int mr, nr; micro_fn fn; accum_fn accum, accum_a; } kernel_t;
enum { UK_OK = 0, UK_BAD_VARIANT = 1, UK_BAD_BLOCKS = 2, UK_NO_MEMORY = 3, UK_BAD_SHAPE = 4, UK_BAD_ALGO = 5 };
static idx imin(idx a, idx b) { return a < b ? a : b; }
static idx imax(idx a, idx b) { return a > b ? a : b; }

/* v clamped to [lo, hi] as ONNX Runtime's Relu and Clip compute it: v < lo ? lo : v, then v > hi ? hi : v, so
   NaN stays NaN and -0.0 stays -0.0. VMAX(a, b) is a > b ? a : b on every target (x86's max_ps returns its
   second operand when either is NaN or both are zero; NEON's is made so), hence the operand order. */
#define VCLAMP(v, vlo, vhi) VMIN(vhi, VMAX(vlo, v))
/* The bias of an output that has none: -0.0 is the identity of float addition (x + 0.0 would turn -0.0 into
   0.0, where ONNX Runtime's Relu keeps -0.0). */
#define NO_BIAS (-0.0f)
static inline float clampf(float v, float lo, float hi) {
    v = v < lo ? lo : v;
    return v > hi ? hi : v;
}

/* The generic epilogue of a partial tile t (m x n of an ldt-wide tile) into C. */
static void tile_epilogue(const float *t, int ldt, float *c, idx rsc, int m, int n, int first, int last,
                          const epi_t *e, const float *bias) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float v = e->alpha * t[i * ldt + j];
            if (!first) v += c[i * rsc + j];
            if (last) {
                if (bias) v += bias[i * e->brs + j * e->bcs];
                if (e->clamp) v = clampf(v, e->lo, e->hi);
            }
            c[i * rsc + j] = v;
        }
}
"""

COMMON = r"""
/* Pack an mc x kc block of A (strides rsa, csa) into MR-row panels, k-major, zero-padded to whole panels. */
static void pack_a(int MR, idx mc, idx kc, const float *a, idx rsa, idx csa, float *ap) {
    for (idx ir = 0; ir < mc; ir += MR, ap += MR * kc) {
        int m = (int)imin(MR, mc - ir);
        const float *ai = a + ir * rsa;
        if (csa == 1) {
            for (int i = 0; i < MR; i++)
                for (idx p = 0; p < kc; p++) ap[p * MR + i] = i < m ? ai[i * rsa + p] : 0.0f;
        } else {
            for (idx p = 0; p < kc; p++)
                for (int i = 0; i < MR; i++) ap[p * MR + i] = i < m ? ai[i * rsa + p * csa] : 0.0f;
        }
    }
}

/* Pack a kc x nc block of B (strides rsb, csb) into NR-column panels, zero-padded to whole panels. */
static void pack_b(int NR, idx kc, idx nc, const float *b, idx rsb, idx csb, float *bp) {
    for (idx jr = 0; jr < nc; jr += NR, bp += NR * kc) {
        int n = (int)imin(NR, nc - jr);
        const float *bj = b + jr * csb;
        if (n == NR && csb == 1) {
            for (idx p = 0; p < kc; p++) memcpy(bp + p * NR, bj + p * rsb, sizeof(float) * NR);
        } else {
            for (int j = 0; j < NR; j++)
                for (idx p = 0; p < kc; p++) bp[p * NR + j] = j < n ? bj[p * rsb + j * csb] : 0.0f;
        }
    }
}

typedef struct { int mc, kc, nc; } blocks_t;
typedef struct conv_s {
    const kernel_t *k; blocks_t bl; idx N, C, H, W, OC, KH, KW, sh, sw, pt, pl, dh, dw, G, OH, OW;
    const float *x, *w, *bias; float *y; int clamp; float lo, hi; int inner_threads; const float *packed;
    int algo, accumulate;  /* accumulate: add what y holds (a residual) before the bias and clamp */
    idx HPp, WPp;  /* one phase plane of the padded input (see fill_phases); tap planes are HPp x OW */
    const idx *boff;  /* per row k = (c, kh, kw) of the im2col matrix: where its run starts in the planes */
} conv_t;
enum { ALGO_IM2COL = 0, ALGO_DIRECT = 1, ALGO_IMPLICIT = 2, ALGO_IMPLICIT_OC = 3 };

/* Append count values (from src, or zeros when src is NULL) to a panel row being packed: NR floats per panel,
   consecutive panels NR * kc apart. */
static void emit(float **panel, int *jj, int NR, idx kc, const float *src, idx count) {
    while (count > 0) {
        idx take = imin(count, NR - *jj);
        if (src) { memcpy(*panel + *jj, src, sizeof(float) * take); src += take; }
        else memset(*panel + *jj, 0, sizeof(float) * take);
        *jj += (int)take;
        count -= take;
        if (*jj == NR) { *jj = 0; *panel += NR * kc; }
    }
}

/* Pack rows [pc, pc + kc) and columns [jc, jc + nc) of the im2col matrix of one image and group (at x) into
   NR-column panels, straight from the image: the matrix itself is never written. At unit stride each output
   row is a run of zeros, one contiguous copy of the input row, and zeros. */
static void pack_b_conv(const conv_t *cv, const float *x, int NR, idx pc, idx kc, idx jc, idx nc, float *bp) {
    for (idx p = 0; p < kc; p++) {
        idx k = pc + p, c = k / (cv->KH * cv->KW), kh = k / cv->KW % cv->KH, kw = k % cv->KW;
        const float *xc = x + c * cv->H * cv->W;
        float *panel = bp + p * NR;
        int jj = 0;
        idx oh = jc / cv->OW, ow = jc % cv->OW, shift = kw * cv->dw - cv->pl;  /* iw = ow * sw + shift */
        for (idx j = jc, end = jc + nc; j < end; oh++, ow = 0) {
            idx run = imin(cv->OW - ow, end - j), ih = oh * cv->sh - cv->pt + kh * cv->dh;
            j += run;
            if (ih < 0 || ih >= cv->H) { emit(&panel, &jj, NR, kc, NULL, run); continue; }
            const float *xr = xc + ih * cv->W;
            if (cv->sw == 1) {
                idx lo = imin(run, imax(0, -shift - ow)), hi = imax(lo, imin(run, cv->W - shift - ow));
                emit(&panel, &jj, NR, kc, NULL, lo);
                emit(&panel, &jj, NR, kc, xr + ow + lo + shift, hi - lo);
                emit(&panel, &jj, NR, kc, NULL, run - hi);
                continue;
            }
            for (idx t = 0; t < run; t++) {
                idx iw = (ow + t) * cv->sw + shift;
                panel[jj] = iw >= 0 && iw < cv->W ? xr[iw] : 0.0f;
                if (++jj == NR) { jj = 0; panel += NR * kc; }
            }
        }
        emit(&panel, &jj, NR, kc, NULL, jj ? NR - jj : 0);
    }
}

typedef struct {
    const kernel_t *k; blocks_t bl; idx M, N, K; const float *A; idx rsa, csa; const float *B; idx rsb, csb;
    float *C; idx rsc; epi_t e; const float *bias; int split_n;
    const float *packed;  /* A packed whole by uk_pack on side 0, or NULL to pack per block */
    const struct conv_s *conv;  /* when set, B is the implicit im2col matrix of conv over the image at B */
    int accumulate;  /* C's contents are added: the first k block does not overwrite them */
    const idx *boff;  /* when set, B(k, q) = B[boff[k] + q] over virtual columns q of rows vw wide, of which
                         the first ow are kept: C row i, column q goes to C[i * rsc + q / vw * ow + q % vw] */
    idx vw, ow;
    const float *packed_b;  /* B packed whole by uk_pack on side 1 (NR-column panels of all K), or NULL */
} gemm_t;

static idx round_up(idx x, idx to) { return (x + to - 1) / to * to; }

/* Working buffers kept by each thread between calls, one per use (a use may run inside another's), grown to
   the largest asked and freed when the thread exits: megabytes allocated and freed on every call cost page
   faults and, with several threads, TLB shootdowns. */
enum { GEMM_A, GEMM_B, CONV_A, CONV_B, CONV_PLANES, CONV_ROWS, SCRATCH_USES };
typedef struct { float *p[SCRATCH_USES]; size_t bytes[SCRATCH_USES]; } scratch_t;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *arg) {
    scratch_t *s = (scratch_t *)arg;
    for (int i = 0; i < SCRATCH_USES; i++) free(s->p[i]);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }
static float *scratch(int use, idx n) {
    pthread_once(&scratch_once, scratch_init);
    scratch_t *s = (scratch_t *)pthread_getspecific(scratch_key);
    if (!s) {
        s = (scratch_t *)calloc(1, sizeof(scratch_t));
        if (!s || pthread_setspecific(scratch_key, s) != 0) { free(s); return NULL; }
    }
    size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63) & ~(size_t)63;
    if (s->bytes[use] < bytes) {
        free(s->p[use]);
        s->p[use] = (float *)aligned_alloc(64, bytes);
        s->bytes[use] = s->p[use] ? bytes : 0;
    }
    return s->p[use];
}

/* y = clamp(x + b + add) over n floats (add may be NULL, and may be y itself); the last partial vector is
   loaded and stored under a lane mask. */
static void epilogue_row(idx n, const float *x, const float *add, float b, int clamp, float lo, float hi,
                         float *y) {
    vf vb = VSET1(b), vlo = VSET1(lo), vhi = VSET1(hi);
    idx j = 0;
    for (; j + LANES <= n; j += LANES) {
        vf v = VADD(VLOAD(x + j), vb);
        if (add) v = VADD(v, VLOAD(add + j));
        if (clamp) v = VCLAMP(v, vlo, vhi);
        VSTORE(y + j, v);
    }
    if (j < n) {
        vf v = VADD(VLOADN(x + j, n - j), vb);
        if (add) v = VADD(v, VLOADN(add + j, n - j));
        if (clamp) v = VCLAMP(v, vlo, vhi);
        VSTOREN(y + j, v, n - j);
    }
}

/* Store tile t (m x n, ldt wide) of virtual columns [col, col + n) from row `row` into C, dropping the columns
   past ow in each virtual row. */
static void store_virtual(const gemm_t *g, const float *t, int ldt, idx row, idx col, int m, int n, int first,
                          int last) {
    for (idx q = col, end = col + n; q < end;) {
        idx r = q / g->vw, c = q % g->vw, run = imin(end - q, g->vw - c), keep = imin(run, g->ow - c);
        for (int i = 0; i < m && keep > 0; i++) {
            float *dst = g->C + (row + i) * g->rsc + r * g->ow + c;
            float b = last && g->bias ? g->bias[(row + i) * g->e.brs] : NO_BIAS;
            epilogue_row(keep, t + i * ldt + (q - col), first ? NULL : dst, b, last && g->e.clamp, g->e.lo,
                         g->e.hi, dst);
        }
        q += run;
    }
}

/* C[M x N] = epilogue(alpha * A B), one thread, with caller's packing buffers. */
static void gemm_serial(const gemm_t *g, idx m0, idx m1, idx n0, idx n1, float *ap, float *bp) {
    const int MR = g->k->mr, NR = g->k->nr;
    const idx K = g->K;
    _Alignas(64) float t[MAX_TILE];
    for (idx jc = n0; jc < n1; jc += g->bl.nc) {
        idx nb = imin(g->bl.nc, n1 - jc);
        for (idx pc = 0; pc < K || pc == 0; pc += g->bl.kc) {
            idx kb = imin(g->bl.kc, K - pc);
            int first = pc == 0 && !g->accumulate, last = pc + kb >= K;
            if (g->boff || g->packed_b) {}  /* B is read in place, or was packed whole */
            else if (g->conv) pack_b_conv(g->conv, g->B, NR, pc, kb, jc, nb, bp);
            else pack_b(NR, kb, nb, g->B + pc * g->rsb + jc * g->csb, g->rsb, g->csb, bp);
            for (idx ic = m0; ic < m1; ic += g->bl.mc) {
                idx mb = imin(g->bl.mc, m1 - ic);
                const float *a = g->packed ? g->packed + pc * round_up(g->M, MR) + ic * kb : ap;
                if (!g->packed) pack_a(MR, mb, kb, g->A + ic * g->rsa + pc * g->csa, g->rsa, g->csa, ap);
                for (idx jr = 0; jr < nb; jr += NR)
                    for (idx ir = 0; ir < mb; ir += MR) {
                        idx row = ic + ir, col = jc + jr;
                        int m = (int)imin(MR, mb - ir), n = (int)imin(NR, nb - jr);
                        if (g->boff) {
                            g->k->accum(kb, a + ir * kb, g->B + col, g->boff + pc, t);
                            store_virtual(g, t, NR, row, col, m, n, first, last);
                            continue;
                        }
                        const float *bias = g->bias ? g->bias + row * g->e.brs + col * g->e.bcs : NULL;
                        const float *b = g->packed_b ? g->packed_b + col * K + pc * NR : bp + jr * kb;
                        g->k->fn(kb, a + ir * kb, b, g->C + row * g->rsc + col, g->rsc, m, n, first, last, &g->e,
                                 bias);
                    }
            }
        }
    }
}

/* Run fn over [0, items) split into `threads` contiguous ranges: range 0 on the caller, the others on a
   pool of workers. Between jobs a worker spins for SPIN_NS (waking a sleeping CPU costs tens of
   microseconds on a VM, more than many calls take), then sleeps on a condition variable; uk_rest sends
   spinning workers to sleep at once (a caller done for now, whose process runs other work next). One caller
   uses the pool at a time; a call made while it is busy (from another thread, or from inside a job) starts
   threads of its own. */
typedef void (*range_fn)(void *ctx, idx begin, idx end);
typedef struct { range_fn fn; void *ctx; idx begin, end; } range_t;
enum { MAX_THREADS = 64 };
#define SPIN_NS 50000L
static struct {
    pthread_mutex_t busy, mu;
    pthread_cond_t wake, done;
    int size, threads;       /* workers started; ranges in the current job */
    atomic_int pending;      /* workers still in the current job */
    atomic_ulong job;        /* bumped for every job, after its ranges are written */
    atomic_int resting;      /* set by uk_rest, cleared by the next job: workers sleep instead of spinning */
    range_t r[MAX_THREADS];
    unsigned long born[MAX_THREADS];  /* the last job posted before each worker started: it waits for the next */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, {{0}}, {0}};
static void *range_main(void *arg) { range_t *r = (range_t *)arg; r->fn(r->ctx, r->begin, r->end); return NULL; }
static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}
/* Spin until done() or SPIN_NS pass; whether done() held. */
static int spin_until(int (*done)(unsigned long), unsigned long arg) {
    long start = now_ns();
    for (int i = 1; !done(arg); i++)
        if (i % 64 == 0 && now_ns() - start > SPIN_NS) return 0;
    return 1;
}
static int job_after(unsigned long seen) { return atomic_load_explicit(&pool.job, memory_order_acquire) != seen; }
static int job_or_rest(unsigned long seen) {
    return job_after(seen) || atomic_load_explicit(&pool.resting, memory_order_relaxed);
}
static int job_done(unsigned long unused) {
    (void)unused;
    return atomic_load_explicit(&pool.pending, memory_order_acquire) == 0;
}
static void *pool_worker(void *arg) {
    int t = (int)(idx)arg;
    unsigned long seen = pool.born[t];
    for (;;) {
        spin_until(job_or_rest, seen);
        if (!job_after(seen)) {
            pthread_mutex_lock(&pool.mu);
            while (!job_after(seen)) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load_explicit(&pool.job, memory_order_acquire);
        if (t >= pool.threads) continue;
        range_main(&pool.r[t]);
        if (atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}
/* A forked child has none of the parent's workers. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = pool.threads = 0;
    atomic_store(&pool.pending, 0);
}
__attribute__((constructor)) static void pool_register(void) { pthread_atfork(NULL, NULL, pool_after_fork); }
/* Workers 1 .. threads-1 exist; 0 when one cannot be started. */
static int pool_ready(int threads) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.size < threads - 1) {
        pthread_t tid;
        pool.born[pool.size + 1] = atomic_load(&pool.job);
        if (pthread_create(&tid, &attr, pool_worker, (void *)(idx)(pool.size + 1)) != 0) break;
        pool.size++;
    }
    pthread_attr_destroy(&attr);
    return pool.size >= threads - 1;
}
static int pool_run(int threads, idx items, range_fn fn, void *ctx) {
    if (pthread_mutex_trylock(&pool.busy) != 0) return 0;
    if (!pool_ready(threads)) {
        pthread_mutex_unlock(&pool.busy);
        return 0;
    }
    for (int t = 0; t < threads; t++) pool.r[t] = (range_t){fn, ctx, items * t / threads, items * (t + 1) / threads};
    pool.threads = threads;
    atomic_store_explicit(&pool.resting, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.job, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    range_main(&pool.r[0]);
    if (!spin_until(job_done, 0)) {
        pthread_mutex_lock(&pool.mu);
        while (!job_done(0)) pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.busy);
    return 1;
}
void uk_rest(void) { atomic_store_explicit(&pool.resting, 1, memory_order_relaxed); }

static void parallel_for(int threads, idx items, range_fn fn, void *ctx) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = (int)items;
    if (threads <= 1) { if (items > 0) fn(ctx, 0, items); return; }
    if (pool_run(threads, items, fn, ctx)) return;
    pthread_t tid[MAX_THREADS];
    range_t r[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        r[t] = (range_t){fn, ctx, items * t / threads, items * (t + 1) / threads};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, range_main, &r[t]) == 0;
    }
    range_main(&r[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL); else range_main(&r[t]);
    }
}

static void gemm_range(void *ctx, idx begin, idx end) {
    const gemm_t *g = (const gemm_t *)ctx;
    int MR = g->k->mr, NR = g->k->nr;
    float *ap = scratch(GEMM_A, (idx)g->bl.mc * imin(g->bl.kc, imax(g->K, 1)));
    float *bp = scratch(GEMM_B, (idx)g->bl.nc * imin(g->bl.kc, imax(g->K, 1)));
    if (ap && bp) {
        if (g->split_n) gemm_serial(g, 0, g->M, imin(begin * NR, g->N), imin(end * NR, g->N), ap, bp);
        else gemm_serial(g, imin(begin * MR, g->M), imin(end * MR, g->M), 0, g->N, ap, bp);
    }
}

static int check_blocks(const kernel_t *k, blocks_t bl) {
    return bl.mc >= k->mr && bl.mc % k->mr == 0 && bl.nc >= k->nr && bl.nc % k->nr == 0 && bl.kc >= 1;
}

static int gemm_run(gemm_t *g, int threads) {
    idx nblocks = (g->N + g->k->nr - 1) / g->k->nr, mblocks = (g->M + g->k->mr - 1) / g->k->mr;
    g->split_n = nblocks >= 2 * (idx)threads || nblocks >= mblocks;
    parallel_for(threads, g->split_n ? nblocks : mblocks, gemm_range, g);
    return UK_OK;
}

int uk_variants(void) { return (int)(sizeof(KERNELS) / sizeof(KERNELS[0])); }
int uk_variant_mr(int v) { return v >= 0 && v < uk_variants() ? KERNELS[v].mr : 0; }
int uk_variant_nr(int v) { return v >= 0 && v < uk_variants() ? KERNELS[v].nr : 0; }

/* Floats uk_pack writes for G groups of M x K on `side`. */
idx uk_packed_size(int variant, int side, idx G, idx M, idx K) {
    if (variant < 0 || variant >= uk_variants()) return 0;
    return G * round_up(M, side ? KERNELS[variant].nr : KERNELS[variant].mr) * K;
}

/* Pack G groups of an M x K matrix (group g at A + g * M * rsa) whole: on side 0 as A in the block order gemm
   reads with kc; on side 1 its transpose as B, NR-column panels over the whole of K (the implicit-oc
   convolution's weights). */
int uk_pack(int variant, int side, int kc, idx G, idx M, idx K, const float *A, idx rsa, idx csa, float *out) {
    if (variant < 0 || variant >= uk_variants()) return UK_BAD_VARIANT;
    if (kc < 1) return UK_BAD_BLOCKS;
    idx pad = round_up(M, side ? KERNELS[variant].nr : KERNELS[variant].mr);
    for (idx g = 0; g < G; g++) {
        if (side) {
            pack_b(KERNELS[variant].nr, K, M, A + g * M * rsa, csa, rsa, out + g * pad * K);
            continue;
        }
        for (idx pc = 0; pc < K; pc += kc)
            pack_a(KERNELS[variant].mr, M, imin(kc, K - pc), A + g * M * rsa + pc * csa, rsa, csa,
                   out + g * pad * K + pc * pad);
    }
    return UK_OK;
}

/* C = clamp(alpha * A B + bias, lo, hi); bias[i * brs + j * bcs] (strides 0 broadcast), C row stride rsc.
   With packed (from uk_pack on side 0 with the same variant and kc), A is not read; with packed_b (B^T through
   uk_pack on side 1, same variant), B is not. */
int uk_gemm(int variant, int threads, int mc, int kc, int nc, idx M, idx N, idx K,
            const float *A, idx rsa, idx csa, const float *B, idx rsb, idx csb, float *C, idx rsc,
            float alpha, const float *bias, idx brs, idx bcs, int clamp, float lo, float hi, const float *packed,
            const float *packed_b) {
    if (variant < 0 || variant >= uk_variants()) return UK_BAD_VARIANT;
    if (M < 0 || N < 0 || K < 0 || rsc < N) return UK_BAD_SHAPE;
    gemm_t g = {&KERNELS[variant], {mc, kc, nc}, M, N, K, A, rsa, csa, B, rsb, csb, C, rsc,
                {alpha, brs, bcs, clamp, lo, hi}, bias, 1, packed, NULL};
    g.packed_b = packed_b;
    if (!check_blocks(g.k, g.bl)) return UK_BAD_BLOCKS;
    if (M == 0 || N == 0) return UK_OK;
    return gemm_run(&g, threads);
}


static int is_pointwise(const conv_t *cv) {
    return cv->KH == 1 && cv->KW == 1 && cv->sh == 1 && cv->sw == 1 && cv->pt == 0 && cv->pl == 0 &&
           cv->OH == cv->H && cv->OW == cv->W;
}

/* Floats of the phase (or tap) planes of `channels` channels, with slack for the reads past the last plane:
   those of five more rows (the direct algorithm's) or of a tile's columns (the implicit GEMMs'). */
static idx phases_size(const conv_t *cv, idx channels) {
    if (cv->algo == ALGO_IMPLICIT_OC) return channels * cv->sh * cv->KW * cv->HPp * cv->OW + MAX_TILE + LANES;
    return channels * cv->sh * cv->sw * cv->HPp * cv->WPp + 6 * cv->WPp + MAX_TILE + LANES;
}

static float *alloc_phases(const conv_t *cv, idx channels) {
    idx size = phases_size(cv, channels);
    float *xp = scratch(CONV_PLANES, size);
    if (xp) memset(xp, 0, sizeof(float) * size);  /* padding and slack stay zero; fill_phases writes the rest */
    return xp;
}

/* Whether some tap t < taps, at t * dilation, lands on `phase` of `stride`: planes of other phases are never
   read, so they are not filled. */
static int phase_read(idx phase, idx stride, idx taps, idx dilation) {
    for (idx t = 0; t < taps; t++)
        if (t * dilation % stride == phase) return 1;
    return 0;
}

/* Split a row of n floats into its even and odd columns, a vector pair at a time (the last pair under masks). */
static void split_row(const float *src, idx n, float *even, float *odd) {
    idx j = 0;
    for (; 2 * (j + LANES) <= n; j += LANES) {
        vf lo = VLOAD(src + 2 * j), hi = VLOAD(src + 2 * j + LANES);
        VSTORE(even + j, VEVEN(lo, hi));
        VSTORE(odd + j, VODD(lo, hi));
    }
    idx rest = n - 2 * j;  /* fewer than 2 * LANES */
    if (rest > 0) {
        vf lo = VLOADN(src + 2 * j, imin(rest, LANES)), hi = VLOADN(src + 2 * j + LANES, imax(rest - LANES, 0));
        VSTOREN(even + j, VEVEN(lo, hi), (rest + 1) / 2);
        VSTOREN(odd + j, VODD(lo, hi), rest / 2);
    }
}

/* Copy `channels` channels of an image (at x) into phase planes: zero-padded, then split by stride phase, so
   every tap of a strided or dilated convolution reads unit-stride runs. Padded pixel (ih, iw) of channel c goes
   to plane ((c * sh + ih % sh) * sw + iw % sw), each HPp x WPp, at (ih / sh, iw / sw). */
static void fill_phases(const conv_t *cv, const float *x, idx channels, float *xp) {
    enum { MAX_STRIDE = 16 };  /* wider strides are copied a pixel at a time */
    idx sh = cv->sh, sw = cv->sw, W = cv->W, WPp = cv->WPp, plane = cv->HPp * WPp;
    idx first[MAX_STRIDE], count[MAX_STRIDE], at[MAX_STRIDE];  /* per column phase: first w, how many, where */
    for (idx pw = 0; pw < sw && sw <= MAX_STRIDE; pw++) {
        first[pw] = ((pw - cv->pl) % sw + sw) % sw;
        count[pw] = first[pw] < W && phase_read(pw, sw, cv->KW, cv->dw) ? (W - first[pw] + sw - 1) / sw : 0;
        at[pw] = pw * plane + (first[pw] + cv->pl) / sw;
    }
    for (idx c = 0; c < channels; c++)
        for (idx h = 0, ph = cv->pt % sh, r = cv->pt / sh; h < cv->H; h++, r += ph == sh - 1,
             ph = ph == sh - 1 ? 0 : ph + 1) {  /* padded row h + pt is row r of row phase ph */
            const float *src = x + (c * cv->H + h) * W;
            float *row = xp + (c * sh + ph) * sw * plane + r * WPp;
            if (sh > 1 && !phase_read(ph, sh, cv->KH, cv->dh)) continue;
            if (sw == 1) {
                memcpy(row + cv->pl, src, sizeof(float) * W);
            } else if (sw > MAX_STRIDE) {
                for (idx w = 0, iw = cv->pl; w < W; w++, iw++) row[iw % sw * plane + iw / sw] = src[w];
            } else if (sw == 2 && count[0] && count[1]) {  /* both column phases read: split in registers */
                idx even = first[0] ? 1 : 0;  /* the phase of column 0 */
                split_row(src, W, row + at[even], row + at[1 - even]);
            } else {
                for (idx pw = 0; pw < sw; pw++) {
                    const float *restrict from = src + first[pw];
                    float *restrict to = row + at[pw];
                    if (sw == 2) for (idx j = 0; j < count[pw]; j++) to[j] = from[2 * j];  /* vectorized */
                    else for (idx j = 0; j < count[pw]; j++) to[j] = from[j * sw];
                }
            }
        }
}

/* Copy `channels` channels of an image (at x) into tap planes: for channel c, row phase ph and kernel column kw,
   a plane of HPp x OW floats holding padded pixel (r * sh + ph, ow * sw + kw * dw) at (r, ow), zero where that
   is padding. Output pixels follow each other without gaps: pixel q = oh * OW + ow reads each tap at one
   offset from q. */
static void fill_taps(const conv_t *cv, const float *x, idx channels, float *xp) {
    idx sh = cv->sh, sw = cv->sw, OW = cv->OW, plane = cv->HPp * OW;
    for (idx kw = 0; kw < cv->KW; kw++) {
        idx shift = kw * cv->dw - cv->pl;  /* input column of output column ow: ow * sw + shift */
        idx lo = shift >= 0 ? 0 : (-shift + sw - 1) / sw, hi = imin(OW, (cv->W - shift + sw - 1) / sw);
        for (idx c = 0; c < channels; c++)
            for (idx ph = 0; ph < sh; ph++) {
                if (!phase_read(ph, sh, cv->KH, cv->dh)) continue;
                float *dst = xp + ((c * sh + ph) * cv->KW + kw) * plane;
                for (idx r = 0, ih = ph - cv->pt; r < cv->HPp; r++, ih += sh) {
                    if (ih < 0 || ih >= cv->H || lo >= hi) continue;  /* padding rows stay zero */
                    const float *restrict from = x + (c * cv->H + ih) * cv->W + lo * sw + shift;
                    float *restrict to = dst + r * OW + lo;
                    if (sw == 1) memcpy(to, from, sizeof(float) * (hi - lo));
                    else if (sw == 2) for (idx j = 0; j < hi - lo; j++) to[j] = from[2 * j];  /* vectorized */
                    else for (idx j = 0; j < hi - lo; j++) to[j] = from[j * sw];
                }
            }
    }
}

/* Where row k = (c, kh, kw) of the im2col matrix starts in the planes: output (oh, ow), at column q = oh * WPp + ow
   of the phase planes (q = oh * OW + ow of the tap planes of the implicit-oc algorithm), reads boff[k] + q. */
static void tap_offsets(const conv_t *cv, idx Cg, idx *boff) {
    int taps = cv->algo == ALGO_IMPLICIT_OC;
    idx plane = cv->HPp * (taps ? cv->OW : cv->WPp);
    for (idx c = 0; c < Cg; c++)
        for (idx kh = 0; kh < cv->KH; kh++)
            for (idx kw = 0; kw < cv->KW; kw++) {
                idx ih = kh * cv->dh, iw = kw * cv->dw, k = (c * cv->KH + kh) * cv->KW + kw;
                boff[k] = taps ? ((c * cv->sh + ih % cv->sh) * cv->KW + kw) * plane + ih / cv->sh * cv->OW
                               : ((c * cv->sh + ih % cv->sh) * cv->sw + iw % cv->sw) * plane + ih / cv->sh * cv->WPp +
                                 iw / cv->sw;
            }
}

/* One image and group of the implicit-oc convolution: output pixels are the rows of A, read in place from
   tap planes, output channels the vectors of B, the weights packed as NR-column panels. */
typedef struct { const conv_t *cv; const float *xp, *wp, *bias; float *y; idx P, OCg, Kg; } rows_t;

static void conv_rows_range(void *ctx, idx begin, idx end) {
    const rows_t *r = (const rows_t *)ctx;
    const conv_t *cv = r->cv;
    const int MR = cv->k->mr, NR = cv->k->nr;
    _Alignas(64) float t[MAX_TILE];
    float column[MAX_TILE];
    idx tiles = (r->P + MR - 1) / MR;
    for (idx item = begin; item < end; item++) {  /* item = panel * tiles + tile: threads split the panels */
        idx jr = item / tiles * NR, ir = item % tiles * MR;
        int m = (int)imin(MR, r->P - ir), n = (int)imin(NR, r->OCg - jr);
        cv->k->accum_a(r->Kg, r->xp + ir, r->wp + jr * r->Kg, cv->boff, t);
        for (int j = 0; j < n; j++) {  /* the tile's column j is output channel jr + j: a run of pixels */
            float *dst = r->y + (jr + j) * r->P + ir;
            for (int i = 0; i < m; i++) column[i] = t[i * NR + j];
            epilogue_row(m, column, cv->accumulate ? dst : NULL, r->bias ? r->bias[jr + j] : NO_BIAS, cv->clamp,
                         cv->lo, cv->hi, dst);
        }
    }
}

/* One (image, group) of a GEMM convolution: Y_g = W_g col + bias, where col is the im2col matrix, packed from
   the image (im2col) or read in place from its phase planes xp over the virtual grid OH x WPp (implicit); or
   Y_g^T = col^T W_g^T, col^T read in place from tap planes (implicit-oc). */
static void conv_gemm_item(const conv_t *cv, idx item, float *ap, float *bp, float *xp, int threads) {
    idx n = item / cv->G, gi = item % cv->G, Cg = cv->C / cv->G, OCg = cv->OC / cv->G;
    idx Kg = Cg * cv->KH * cv->KW, P = cv->OH * cv->OW;
    const float *x = cv->x + (n * cv->C + gi * Cg) * cv->H * cv->W;
    gemm_t g = {cv->k, cv->bl, OCg, P, Kg, cv->w + gi * OCg * Kg, Kg, 1, x, P, 1,
                cv->y + (n * cv->OC + gi * OCg) * P, P, {1.0f, 1, 0, cv->clamp, cv->lo, cv->hi},
                cv->bias ? cv->bias + gi * OCg : NULL, 1,
                cv->packed ? cv->packed + gi * round_up(OCg, cv->k->mr) * Kg : NULL, is_pointwise(cv) ? NULL : cv,
                cv->accumulate, NULL, 0, 0};
    if (cv->algo == ALGO_IMPLICIT_OC) {
        int NR = cv->k->nr;
        const float *wp = cv->packed ? cv->packed + gi * round_up(OCg, NR) * Kg : bp;
        if (!cv->packed) pack_b(NR, Kg, OCg, g.A, 1, Kg, bp);
        fill_taps(cv, x, Cg, xp);
        rows_t r = {cv, xp, wp, g.bias, g.C, P, OCg, Kg};
        idx tiles = (P + cv->k->mr - 1) / cv->k->mr, panels = (OCg + NR - 1) / NR;
        parallel_for(threads, tiles * panels, conv_rows_range, &r);
        return;
    }
    if (cv->algo == ALGO_IMPLICIT) {
        fill_phases(cv, x, Cg, xp);
        g.B = xp, g.conv = NULL, g.boff = cv->boff, g.N = cv->OH * cv->WPp, g.vw = cv->WPp, g.ow = cv->OW;
    }
    if (threads > 1) gemm_run(&g, threads); else gemm_serial(&g, 0, g.M, 0, g.N, ap, bp);
}

static void conv_gemm_range(void *ctx, idx begin, idx end) {
    const conv_t *cv = (const conv_t *)ctx;
    idx Cg = cv->C / cv->G, Kg = Cg * cv->KH * cv->KW, kb = imin(cv->bl.kc, imax(Kg, 1));
    int rows = cv->algo == ALGO_IMPLICIT_OC;  /* bp then holds the group's weights as B panels */
    float *ap = scratch(CONV_A, (idx)cv->bl.mc * kb);
    float *bp = scratch(CONV_B, rows ? round_up(cv->OC / cv->G, cv->k->nr) * Kg : (idx)cv->bl.nc * kb);
    float *xp = cv->algo >= ALGO_IMPLICIT ? alloc_phases(cv, Cg) : bp;
    if (ap && bp && xp)
        for (idx item = begin; item < end; item++) conv_gemm_item(cv, item, ap, bp, xp, cv->inner_threads);
}

/* The output plane of channel oc (at y) of a direct convolution over its group's phase planes xp, four rows at
   a time (rows past OH are computed from the planes' slack and dropped): each vector of outputs accumulates
   every tap in a register. The three kernel rows of a 3x3 at unit stride (one plane row apart) or at stride 2
   (rows 0 and 2 one row apart in one phase) share their loads across the four output rows. rows holds four
   output rows of OW + LANES floats. */
static void conv_direct_plane(const conv_t *cv, idx oc, const float *xp, float *rows, float *y) {
    idx Kg = cv->C / cv->G * cv->KH * cv->KW, KW = cv->KW, OW = cv->OW, WPp = cv->WPp, RW = OW + LANES;
    const float *wo = cv->w + oc * Kg;
    vf b = VSET1(cv->bias ? cv->bias[oc] : 0.0f);
    int unit = cv->KH == 3 && cv->dh == cv->sh, two = cv->KH == 3 && cv->sh == 2 && cv->dh == 1, three = unit || two;
    for (idx oh = 0; oh < cv->OH; oh += 4) {
        for (idx ow = 0; ow < OW; ow += LANES) {
            const float *xr = xp + oh * WPp + ow;
            vf a0 = b, a1 = b, a2 = b, a3 = b;
            for (idx k0 = 0; three && k0 < Kg; k0 += 3 * KW) {
                for (idx k = k0; k < k0 + KW; k++) {  /* the taps of kh = 0 of one channel */
                    vf w0 = VSET1(wo[k]), w1 = VSET1(wo[k + KW]), w2 = VSET1(wo[k + 2 * KW]);
                    const float *x0 = xr + cv->boff[k], *x1 = xr + cv->boff[k + KW];
                    if (unit) {  /* kernel row kh reads row oh + kh of x0 */
UNIT_STRIDE_TAPS
                    } else {  /* kernel rows 0 and 2 read rows oh and oh + 1 of x0, kernel row 1 row oh of x1 */
STRIDE_TWO_TAPS
                    }
                }
            }
            for (idx k = 0; !three && k < Kg; k++) {
                vf wv = VSET1(wo[k]);
                const float *xk = xr + cv->boff[k];
                a0 = VFMA(wv, VLOAD(xk), a0);
                a1 = VFMA(wv, VLOAD(xk + WPp), a1);
                a2 = VFMA(wv, VLOAD(xk + 2 * WPp), a2);
                a3 = VFMA(wv, VLOAD(xk + 3 * WPp), a3);
            }
            VSTORE(rows + ow, a0);
            VSTORE(rows + RW + ow, a1);
            VSTORE(rows + 2 * RW + ow, a2);
            VSTORE(rows + 3 * RW + ow, a3);
        }
        for (idx r = 0; r < 4 && oh + r < cv->OH; r++) {
            float *yr = y + (oh + r) * OW;
            epilogue_row(OW, rows + r * RW, cv->accumulate ? yr : NULL, NO_BIAS, cv->clamp, cv->lo, cv->hi, yr);
        }
    }
}

static void conv_direct_range(void *ctx, idx begin, idx end) {
    const conv_t *cv = (const conv_t *)ctx;
    idx Cg = cv->C / cv->G, OCg = cv->OC / cv->G, P = cv->OH * cv->OW;
    float *xp = alloc_phases(cv, Cg), *rows = scratch(CONV_ROWS, 4 * (cv->OW + LANES));
    if (xp && rows)
        for (idx item = begin; item < end; item++) {
            idx n = item / cv->G, gi = item % cv->G;
            fill_phases(cv, cv->x + (n * cv->C + gi * Cg) * cv->H * cv->W, Cg, xp);
            for (idx oc = gi * OCg; oc < (gi + 1) * OCg; oc++)
                conv_direct_plane(cv, oc, xp, rows, cv->y + (n * cv->OC + oc) * P);
        }
}

/* NCHW convolution with OIHW weights, groups, strides, pads, dilations; algo 0 GEMM over packed im2col panels,
   1 direct, 2 implicit GEMM over the phase planes, 3 implicit GEMM over tap planes with output channels in
   vectors (packed by uk_pack on side 1). With accumulate, y holds a residual to add. */
int uk_conv2d(int variant, int threads, int mc, int kc, int nc, int algo,
              idx N, idx C, idx H, idx W, idx OC, idx KH, idx KW, idx sh, idx sw, idx pt, idx pl, idx pb, idx pr,
              idx dh, idx dw, idx G, const float *x, const float *w, const float *bias, float *y, int accumulate,
              int clamp, float lo, float hi, const float *packed) {
    if (variant < 0 || variant >= uk_variants()) return UK_BAD_VARIANT;
    if (algo < ALGO_IM2COL || algo > ALGO_IMPLICIT_OC) return UK_BAD_ALGO;
    if (N < 0 || C < 1 || H < 1 || W < 1 || OC < 1 || KH < 1 || KW < 1 || sh < 1 || sw < 1 || dh < 1 || dw < 1 ||
        pt < 0 || pl < 0 || pb < 0 || pr < 0 || G < 1 || C % G || OC % G)
        return UK_BAD_SHAPE;
    idx OH = (H + pt + pb - dh * (KH - 1) - 1) / sh + 1, OW = (W + pl + pr - dw * (KW - 1) - 1) / sw + 1;
    if (H + pt + pb < dh * (KH - 1) + 1 || W + pl + pr < dw * (KW - 1) + 1) return UK_BAD_SHAPE;
    idx Kg = C / G * KH * KW;
    idx *boff = (idx *)malloc(sizeof(idx) * Kg);
    if (!boff) return UK_NO_MEMORY;
    conv_t cv = {&KERNELS[variant], {mc, kc, nc}, N, C, H, W, OC, KH, KW, sh, sw, pt, pl, dh, dw, G, OH, OW,
                 x, w, bias, y, clamp, lo, hi, 1, packed, algo, accumulate,
                 (H + pt + pb + sh - 1) / sh, (W + pl + pr + sw - 1) / sw, boff};
    tap_offsets(&cv, C / G, boff);
    int rc = check_blocks(cv.k, cv.bl) ? UK_OK : UK_BAD_BLOCKS;
    if (rc == UK_OK) {
        if (algo == ALGO_DIRECT) {
            parallel_for(threads, N * G, conv_direct_range, &cv);
        } else if (N * G >= threads) {
            parallel_for(threads, N * G, conv_gemm_range, &cv);
        } else {
            cv.inner_threads = threads;
            conv_gemm_range(&cv, 0, N * G);
        }
    }
    free(boff);
    return rc;
}

/* y = clamp(x + bias[c] + res) over an (outer, channels, inner) view; bias and res (shaped as x) may be NULL. */
int uk_bias_act(idx outer, idx channels, idx inner, const float *x, float *y, const float *bias, const float *res,
                int clamp, float lo, float hi) {
    if (outer < 0 || channels < 0 || inner < 0) return UK_BAD_SHAPE;
    for (idx o = 0; o < outer; o++)
        for (idx c = 0; c < channels; c++) {
            idx at = (o * channels + c) * inner;
            epilogue_row(inner, x + at, res ? res + at : NULL, bias ? bias[c] : NO_BIAS, clamp, lo, hi, y + at);
        }
    return UK_OK;
}

/* The textbook triple loop, for comparison in benchmarks. */
int uk_gemm_naive(idx M, idx N, idx K, const float *A, const float *B, float *C) {
    for (idx i = 0; i < M; i++)
        for (idx j = 0; j < N; j++) {
            float s = 0.0f;
            for (idx p = 0; p < K; p++) s += A[i * K + p] * B[p * N + j];
            C[i * N + j] = s;
        }
    return UK_OK;
}
"""


def micro_kernel(mk: MicroKernel, target: Target, unroll: int) -> str:
    """C for one `mr` x `nr` micro-kernel: accumulators c_i_j in named variables, a full-tile vector store with
    the epilogue, and the generic epilogue for edge tiles and unusual bias strides. Its twins leave the tile in t
    for the caller and read one operand in place from an implicit-GEMM convolution's image: `accum_` row p of B
    at `b + off[p]`, `accum_a_` column p of A at `a + off[p]` (B packed)."""
    lanes, mr, nr = target.lanes, mk.mr, mk.nr
    vecs = range(nr // lanes)
    rows = range(mr)
    acc = [[f"c_{i}_{j}" for j in vecs] for i in rows]

    def k_loop(row: str, column: str = f"a + p * {mr}") -> str:
        loads = "\n".join(f"        vf b_{j} = VLOAD({row} + {j * lanes});" for j in vecs)
        fmas = "\n".join(
            f"        a_ = VBCAST({column} + {i});\n"
            + "\n".join(f"        {acc[i][j]} = VFMA(a_, b_{j}, {acc[i][j]});" for j in vecs)
            for i in rows
        )
        return "\n".join([
            "\n".join(f"    vf {', '.join(f'{name} = VZERO()' for name in row_)};" for row_ in acc),
            "    vf a_;",
            f"#pragma GCC unroll {unroll}",
            "    for (idx p = 0; p < kc; p++) {",
            loads,
            fmas,
            "    }",
        ])

    full = "\n".join(
        f"        {{ vf v = VMUL(va, {acc[i][j]}); float *cp = c + {i} * rsc + {j * lanes};\n"
        f"          if (!first) v = VADD(v, VLOAD(cp));\n"
        f"          if (last) {{ if (bias) v = VADD(v, e->bcs ? VLOAD(bias + {i} * e->brs + {j * lanes}) "
        f": VSET1(bias[{i} * e->brs]));\n"
        f"                      if (e->clamp) v = VCLAMP(v, vlo, vhi); }}\n"
        f"          VSTORE(cp, v); }}"
        for i in rows for j in vecs
    )
    spill = "\n".join(f"        VSTORE(t + {i * nr + j * lanes}, {acc[i][j]});" for i in rows for j in vecs)
    return f"""
static void micro_{mk.name}(idx kc, const float *restrict a, const float *restrict b, float *restrict c, idx rsc,
                           int m, int n, int first, int last, const epi_t *e, const float *bias) {{
{k_loop(f"b + p * {nr}")}
    if (m == {mr} && n == {nr} && (!last || !bias || e->bcs == 0 || e->bcs == 1)) {{
        vf va = VSET1(e->alpha), vlo = VSET1(e->lo), vhi = VSET1(e->hi);
        (void)vlo; (void)vhi;
{full}
    }} else {{
        float t[{mr * nr}];
{spill}
        tile_epilogue(t, {nr}, c, rsc, m, n, first, last, e, bias);
    }}
}}

static void accum_{mk.name}(idx kc, const float *restrict a, const float *restrict b, const idx *restrict off,
                           float *restrict t) {{
{k_loop("b + off[p]")}
    {{
{spill}
    }}
}}

static void accum_a_{mk.name}(idx kc, const float *restrict a, const float *restrict b, const idx *restrict off,
                             float *restrict t) {{
{k_loop(f"b + p * {nr}", "a + off[p]")}
    {{
{spill}
    }}
}}
"""


def shared_row_taps(taps: tuple[tuple[str, int], ...]) -> str:
    """C for one kernel column of a 3x3 direct convolution over four output rows a0..a3: kernel row kh (weight
    wkh) reads, for output row r, plane row `offset + r` at the pointer `taps[kh]` names; each distinct plane row
    is loaded once and feeds every output row that reads it."""
    lines = []
    for name in dict.fromkeys(n for n, _ in taps):
        for i in sorted({offset + r for n, offset in taps if n == name for r in range(4)}):
            lines.append(f"vf {name}_{i} = VLOAD({name} + {i} * WPp);")
            lines += [f"a{i - offset} = VFMA(w{kh}, {name}_{i}, a{i - offset});"
                      for kh, (n, offset) in enumerate(taps) if n == name and 0 <= i - offset < 4]
    return "\n".join(" " * 24 + line for line in lines)


def generate(spec: LibrarySpec) -> str:
    """The complete C source of the library `spec` describes, after checking the spec."""
    target = check_library(spec)
    kernels = "".join(micro_kernel(mk, target, spec.unroll) for mk in spec.micro)
    table = ", ".join(f"{{{mk.mr}, {mk.nr}, micro_{mk.name}, accum_{mk.name}, accum_a_{mk.name}}}"
                      for mk in spec.micro)
    return "\n".join([
        (f"/* uhop-onnx kernels: target {target.name}, micro-kernels {', '.join(m.name for m in spec.micro)}, "
         f"unroll {spec.unroll}. */"),
        target.header,
        PRELUDE,
        VECTOR_MACROS[target.name],
        kernels,
        f"static const kernel_t KERNELS[] = {{{table}}};",
        f"#define MAX_TILE {max(mk.mr * mk.nr for mk in spec.micro)}",
        COMMON.replace("UNIT_STRIDE_TAPS", shared_row_taps((("x0", 0), ("x0", 1), ("x0", 2))))
              .replace("STRIDE_TWO_TAPS", shared_row_taps((("x0", 0), ("x1", 0), ("x0", 1)))),
    ])
