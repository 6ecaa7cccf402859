/* Softmax attention over whole sequences, forward and backward (fp32, CPU), for the policy's core attention:
   study/kernels/attention.py builds and calls it.

   out_i = sum_j p_ij v_j with p_i = softmax_j(scale q_i . k_j) over the keys query i may see: key j is visible
   unless mask[b, i, j] (megatron's boolean mask, True = masked), and a query always sees itself (as the SDPA path
   of study/policy/model.py); with no mask, keys j <= i (causal) or every key. Each query row runs only over the span
   between its first and last visible key, so a causal, left-padded batch does about half of the dense work.

   Layouts: q (B, hq, S, d), k and v (B, hk, S, d), out (B, hq, S, d), contiguous (the caller permutes megatron's
   (S, B, h, d), which keeps d innermost and costs a fast copy); grouped-query attention: query head h reads
   key/value head h / (hq / hk). The forward saves the rows' log-sum-exp (B, hq, S); the
   backward recomputes the probabilities from it (flash attention's scheme) instead of storing them.

   Per (batch row, key/value head), keys (and, backward, values) are copied transposed into a zero-padded (d, Sp)
   buffer, so the scores of four queries accumulate over the head dimension in registers against 16 contiguous keys
   at a time: every loaded key vector feeds four multiply-adds and no sum needs a horizontal reduction. Sums run in
   another order than torch's kernels: results agree to ~1e-6 relative, not bit for bit (tests/study). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma omp declare simd notinbranch
float expf(float);

#define QB 4  /* query rows per block */
#define KB 16 /* keys per score block; Sp, the transposed buffers' row length, is a multiple of it */

typedef struct {
    int64_t S, B, hq, hk, d;
    const uint8_t *mask; /* (B or 1, S, S), 1 = masked; NULL: causal or nothing masked */
    int64_t mask_bstride; /* elements between batch rows of the mask: S * S, or 0 for one mask for all */
    int causal;           /* with no mask: keys j <= i only */
    float scale;
} Shape;

/* The span [lo, hi) of the keys query i of batch row b may see (itself always); returns 1 if it sees every key
   in it (no masked key between its first and last visible one: causal and padding masks), else 0. */
static inline int span(const Shape *s, int64_t b, int64_t i, int64_t *lo, int64_t *hi) {
    if (!s->mask) {
        *lo = 0, *hi = s->causal ? i + 1 : s->S;
        return 1;
    }
    const uint8_t *row = s->mask + b * s->mask_bstride + i * s->S;
    int64_t a = 0, z = s->S;
    while (a < i && row[a]) a++;
    while (z > i + 1 && row[z - 1]) z--;
    int masked = 0; /* masked keys in [a, z) other than i (bool bytes are 0 or 1) */
#pragma omp simd reduction(+ : masked)
    for (int64_t j = a; j < z; j++) masked += row[j];
    *lo = a, *hi = z;
    return masked - row[i] == 0;
}

static inline int visible(const Shape *s, int64_t b, int64_t i, int64_t j) {
    return s->mask ? (j == i || !s->mask[b * s->mask_bstride + i * s->S + j]) : (!s->causal || j <= i);
}

/* out[r][j] = sum_c a[r][c] * t[c][j] for r < QB, j in [j0, j1): a (QB, d) row-major, t (d, ldt) zero-padded to
   a multiple of KB past j1. out (QB, ldo). */
static inline void block_scores(float *restrict out, int64_t ldo, const float *restrict a, const float *restrict t,
                                int64_t ldt, int64_t j0, int64_t j1, const int64_t d) {
    for (int64_t j = j0; j < j1; j += KB) {
        float acc[QB][KB] = {{0}};
        for (int64_t c = 0; c < d; c++) {
            const float *restrict tc = t + c * ldt + j;
#pragma GCC unroll 4
            for (int r = 0; r < QB; r++) {
                const float x = a[r * d + c];
#pragma omp simd
                for (int u = 0; u < KB; u++) acc[r][u] += x * tc[u];
            }
        }
        const int64_t w = j1 - j < KB ? j1 - j : KB;
        for (int r = 0; r < QB; r++) memcpy(out + r * ldo + j, acc[r], sizeof(float) * (size_t)w);
    }
}

/* acc[r][:] = sum_{j in [j0, j1)} w[r][j] * rows_j for r < QB: rows_j = base + j * ld (d floats each). */
static inline void block_mix(float *restrict acc, const float *restrict w, int64_t ldw, const float *base, int64_t ld,
                             int64_t j0, int64_t j1, const int64_t d) {
    for (int64_t x = 0; x < QB * d; x++) acc[x] = 0.0f;
    for (int64_t j = j0; j < j1; j++) {
        const float *restrict row = base + j * ld;
#pragma GCC unroll 4
        for (int r = 0; r < QB; r++) {
            const float p = w[r * ldw + j];
#pragma omp simd
            for (int64_t c = 0; c < d; c++) acc[r * d + c] += p * row[c];
        }
    }
}

/* dst_j += sum_r w[r][j] * a_r for j in [j0, j1), r < QB: a (QB, d), dst (S, d). */
static inline void block_scatter(float *restrict dst, const float *restrict w, int64_t ldw, const float *restrict a,
                                 int64_t j0, int64_t j1, const int64_t d) {
    for (int64_t j = j0; j < j1; j++) {
        float *restrict out = dst + j * d;
        float wr[QB];
        for (int r = 0; r < QB; r++) wr[r] = w[r * ldw + j];
#pragma omp simd
        for (int64_t c = 0; c < d; c++) {
            float sum = out[c];
#pragma GCC unroll 8
            for (int r = 0; r < QB; r++) sum += wr[r] * a[r * d + c];
            out[c] = sum;
        }
    }
}

/* (d, Sp) transpose of an (S, d) block x, zeros past S. */
static void transpose_head(float *restrict t, int64_t Sp, const float *restrict x, int64_t S, int64_t d) {
    memset(t, 0, sizeof(float) * (size_t)(d * Sp));
    for (int64_t j = 0; j < S; j++)
        for (int64_t c = 0; c < d; c++) t[c * Sp + j] = x[j * d + c];
}

/* Rows i0 .. i0 + QB of the (S, d) block x (those < S; the rest zero), times `mul`, into a (QB, d). */
static void load_rows(float *restrict a, const float *restrict x, int64_t S, int64_t i0, float mul, const int64_t d) {
    for (int r = 0; r < QB; r++) {
        const float *restrict row = x + (i0 + r) * d;
        if (i0 + r < S) {
#pragma omp simd
            for (int64_t c = 0; c < d; c++) a[r * d + c] = row[c] * mul;
        } else {
            for (int64_t c = 0; c < d; c++) a[r * d + c] = 0.0f;
        }
    }
}

/* Every query row's span and density (`span`) for batch row b, into lo, hi, dense of S + QB entries (rows past S:
   empty, so a last partial block of queries can read QB entries). */
static void row_spans(const Shape *s, int64_t b, int64_t *lo, int64_t *hi, int *dense) {
    for (int64_t i = 0; i < s->S; i++) dense[i] = span(s, b, i, lo + i, hi + i);
    for (int64_t i = s->S; i < s->S + QB; i++) lo[i] = hi[i] = 0, dense[i] = 1;
}

/* The union [*jlo, *jhi) of the spans of query rows i0 .. i0 + QB. */
static inline void block_union(const Shape *s, const int64_t *lo, const int64_t *hi, int64_t i0, int64_t *jlo,
                               int64_t *jhi) {
    *jlo = s->S, *jhi = 0;
    for (int r = 0; r < QB && i0 + r < s->S; r++) {
        *jlo = lo[i0 + r] < *jlo ? lo[i0 + r] : *jlo;
        *jhi = hi[i0 + r] > *jhi ? hi[i0 + r] : *jhi;
    }
}

static int forward_d(const Shape *s, const float *q, const float *k, const float *v, float *out, float *lse,
                     const int64_t d) {
    const int64_t S = s->S, B = s->B, hq = s->hq, hk = s->hk, group = hq / hk;
    const int64_t Sp = (S + KB - 1) / KB * KB;
    float *kt = malloc(sizeof(float) * (size_t)(d * Sp)), *sc = malloc(sizeof(float) * (size_t)(QB * Sp));
    float *a = malloc(sizeof(float) * (size_t)(QB * d)), *acc = malloc(sizeof(float) * (size_t)(QB * d));
    int64_t *los = malloc(sizeof(int64_t) * (size_t)(S + QB)), *his = malloc(sizeof(int64_t) * (size_t)(S + QB));
    int *denses = malloc(sizeof(int) * (size_t)(S + QB));
    int rc = 0;
    if (!kt || !sc || !a || !acc || !los || !his || !denses) {
        rc = -1;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) {
        row_spans(s, b, los, his, denses);
        for (int64_t g = 0; g < hk; g++) {
            const float *kbh = k + (b * hk + g) * S * d, *vbh = v + (b * hk + g) * S * d; /* (S, d) blocks */
            transpose_head(kt, Sp, kbh, S, d);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const float *qbh = q + (b * hq + h) * S * d;
                float *obh = out + (b * hq + h) * S * d;
                for (int64_t i0 = 0; i0 < S; i0 += QB) {
                    const int64_t *lo = los + i0, *hi = his + i0;
                    const int *dense = denses + i0;
                    int64_t jlo, jhi;
                    block_union(s, los, his, i0, &jlo, &jhi);
                    load_rows(a, qbh, S, i0, s->scale, d);
                    const int64_t j0 = jlo / KB * KB; /* block starts stay KB-aligned: reads stay inside Sp */
                    block_scores(sc, Sp, a, kt, Sp, j0, jhi, d);
                    for (int r = 0; r < QB && i0 + r < S; r++) { /* softmax over the row's visible keys */
                        const int64_t i = i0 + r;
                        float *p = sc + r * Sp, mx = -INFINITY, total = 0.0f;
                        for (int64_t j = jlo; j < lo[r]; j++) p[j] = 0.0f;
                        for (int64_t j = hi[r]; j < jhi; j++) p[j] = 0.0f;
                        if (dense[r]) {
#pragma omp simd reduction(max : mx)
                            for (int64_t j = lo[r]; j < hi[r]; j++) mx = p[j] > mx ? p[j] : mx;
#pragma omp simd reduction(+ : total)
                            for (int64_t j = lo[r]; j < hi[r]; j++) total += (p[j] = expf(p[j] - mx));
                        } else {
                            for (int64_t j = lo[r]; j < hi[r]; j++)
                                if (visible(s, b, i, j) && p[j] > mx) mx = p[j];
                            for (int64_t j = lo[r]; j < hi[r]; j++) {
                                const float e = visible(s, b, i, j) ? expf(p[j] - mx) : 0.0f;
                                p[j] = e;
                                total += e;
                            }
                        }
                        const float inv = 1.0f / total;
#pragma omp simd
                        for (int64_t j = lo[r]; j < hi[r]; j++) p[j] *= inv;
                        lse[(b * hq + h) * S + i] = mx + logf(total);
                    }
                    for (int r = 0; r < QB; r++) /* rows past S weigh nothing */
                        if (i0 + r >= S)
                            for (int64_t j = jlo; j < jhi; j++) sc[r * Sp + j] = 0.0f;
                    block_mix(acc, sc, Sp, vbh, d, jlo, jhi, d);
                    for (int r = 0; r < QB && i0 + r < S; r++)
                        memcpy(obh + (i0 + r) * d, acc + r * d, sizeof(float) * (size_t)d);
                }
            }
        }
    }
done:
    free(kt), free(sc), free(a), free(acc), free(los), free(his), free(denses);
    return rc;
}

static int backward_d(const Shape *s, const float *q, const float *k, const float *v, const float *out,
                      const float *dout, const float *lse, float *dq, float *dk, float *dv, const int64_t d) {
    const int64_t S = s->S, B = s->B, hq = s->hq, hk = s->hk, group = hq / hk;
    const int64_t Sp = (S + KB - 1) / KB * KB;
    float *kt = malloc(sizeof(float) * (size_t)(d * Sp)), *vt = malloc(sizeof(float) * (size_t)(d * Sp));
    float *p = malloc(sizeof(float) * (size_t)(QB * Sp)), *ds = malloc(sizeof(float) * (size_t)(QB * Sp));
    float *qa = malloc(sizeof(float) * (size_t)(QB * d)), *da = malloc(sizeof(float) * (size_t)(QB * d));
    float *acc = malloc(sizeof(float) * (size_t)(QB * d));
    int64_t *los = malloc(sizeof(int64_t) * (size_t)(S + QB)), *his = malloc(sizeof(int64_t) * (size_t)(S + QB));
    int *denses = malloc(sizeof(int) * (size_t)(S + QB));
    int rc = 0;
    if (!kt || !vt || !p || !ds || !qa || !da || !acc || !los || !his || !denses) {
        rc = -1;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) {
        row_spans(s, b, los, his, denses);
        for (int64_t g = 0; g < hk; g++) {
            const float *kbh = k + (b * hk + g) * S * d, *vbh = v + (b * hk + g) * S * d; /* (S, d) blocks */
            transpose_head(kt, Sp, kbh, S, d);
            transpose_head(vt, Sp, vbh, S, d);
            float *dka = dk + (b * hk + g) * S * d, *dva = dv + (b * hk + g) * S * d; /* summed over the group */
            memset(dka, 0, sizeof(float) * (size_t)(S * d));
            memset(dva, 0, sizeof(float) * (size_t)(S * d));
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const float *qbh = q + (b * hq + h) * S * d, *obh = out + (b * hq + h) * S * d;
                const float *dobh = dout + (b * hq + h) * S * d;
                float *dqbh = dq + (b * hq + h) * S * d;
                for (int64_t i0 = 0; i0 < S; i0 += QB) {
                    const int64_t *lo = los + i0, *hi = his + i0;
                    const int *dense = denses + i0;
                    int64_t jlo, jhi;
                    block_union(s, los, his, i0, &jlo, &jhi);
                    const int64_t j0 = jlo / KB * KB;
                    load_rows(qa, qbh, S, i0, s->scale, d);
                    load_rows(da, dobh, S, i0, 1.0f, d);
                    block_scores(p, Sp, qa, kt, Sp, j0, jhi, d);  /* scale q . k */
                    block_scores(ds, Sp, da, vt, Sp, j0, jhi, d); /* dO . v */
                    for (int r = 0; r < QB; r++) {
                        float *pr = p + r * Sp, *dr = ds + r * Sp;
                        const int64_t i = i0 + r;
                        if (i >= S) {
                            for (int64_t j = jlo; j < jhi; j++) pr[j] = dr[j] = 0.0f;
                            continue;
                        }
                        const float *o = obh + i * d, *go = da + r * d, l = lse[(b * hq + h) * S + i];
                        float D = 0.0f; /* sum_j p_ij dp_ij = dO_i . O_i */
                        for (int64_t c = 0; c < d; c++) D += go[c] * o[c];
                        for (int64_t j = jlo; j < lo[r]; j++) pr[j] = 0.0f;
                        for (int64_t j = hi[r]; j < jhi; j++) pr[j] = 0.0f;
                        if (dense[r]) {
#pragma omp simd
                            for (int64_t j = lo[r]; j < hi[r]; j++) pr[j] = expf(pr[j] - l);
                        } else {
                            for (int64_t j = lo[r]; j < hi[r]; j++) pr[j] = visible(s, b, i, j) ? expf(pr[j] - l) : 0.0f;
                        }
#pragma omp simd
                        for (int64_t j = jlo; j < jhi; j++) dr[j] = pr[j] * (dr[j] - D); /* dS_ij, before the scale */
                    }
                    /* dQ_i = scale sum_j dS_ij k_j */
                    block_mix(acc, ds, Sp, kbh, d, jlo, jhi, d);
                    for (int r = 0; r < QB && i0 + r < S; r++) {
                        float *o = dqbh + (i0 + r) * d;
                        for (int64_t c = 0; c < d; c++) o[c] = acc[r * d + c] * s->scale;
                    }
                    /* dK_j += sum_i dS_ij (scale q_i): qa holds the scaled rows; dV_j += sum_i p_ij dO_i */
                    block_scatter(dka, ds, Sp, qa, jlo, jhi, d);
                    block_scatter(dva, p, Sp, da, jlo, jhi, d);
                }
            }
        }
    }
done:
    free(kt), free(vt), free(p), free(ds), free(qa), free(da), free(acc), free(los), free(his), free(denses);
    return rc;
}

static Shape shape(int64_t S, int64_t B, int64_t hq, int64_t hk, int64_t d, const uint8_t *mask, int64_t mask_bstride,
                   int causal, double scale) {
    Shape s = {S, B, hq, hk, d, mask, mask_bstride, causal, (float)scale};
    return s;
}

/* out (B, hq, S, d) and lse (B, hq, S) of the attention of q over k, v (module doc). Returns 0, or -1 if a
   workspace could not be allocated. */
int attention_forward(const float *q, const float *k, const float *v, const uint8_t *mask, int64_t mask_bstride,
                      int causal, int64_t S, int64_t B, int64_t hq, int64_t hk, int64_t d, double scale, float *out,
                      float *lse) {
    const Shape s = shape(S, B, hq, hk, d, mask, mask_bstride, causal, scale);
    if (d == 32) return forward_d(&s, q, k, v, out, lse, 32); /* the common head sizes: loops of a known length */
    if (d == 64) return forward_d(&s, q, k, v, out, lse, 64);
    if (d == 128) return forward_d(&s, q, k, v, out, lse, 128);
    return forward_d(&s, q, k, v, out, lse, d);
}

/* dq (B, hq, S, d), dk and dv (B, hk, S, d) from dout (B, hq, S, d), given the forward's inputs, out and lse.
   Returns 0, or -1 if a workspace could not be allocated. */
int attention_backward(const float *q, const float *k, const float *v, const uint8_t *mask, int64_t mask_bstride,
                       int causal, int64_t S, int64_t B, int64_t hq, int64_t hk, int64_t d, double scale,
                       const float *out, const float *dout, const float *lse, float *dq, float *dk, float *dv) {
    const Shape s = shape(S, B, hq, hk, d, mask, mask_bstride, causal, scale);
    if (d == 32) return backward_d(&s, q, k, v, out, dout, lse, dq, dk, dv, 32);
    if (d == 64) return backward_d(&s, q, k, v, out, dout, lse, dq, dk, dv, 64);
    if (d == 128) return backward_d(&s, q, k, v, out, dout, lse, dq, dk, dv, 128);
    return backward_d(&s, q, k, v, out, dout, lse, dq, dk, dv, d);
}
