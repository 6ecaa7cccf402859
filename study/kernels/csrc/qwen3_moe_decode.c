/* One decode step of a Qwen3-MoE decoder (fp32, CPU) for the hf engine: study/kernels/decode.py builds and calls it.

   The same arithmetic as transformers' Qwen3MoeForCausalLM decode step with the engine's grouped decode attention
   and the `grouped_mm` experts (study/rollout/hf.py `_FusedDecoder`), in one call instead of ~190 torch ops: at the
   tiny preset's sizes each of those ops is a few microseconds of dispatch around a few of work. Sums run in another
   order than torch's vectorised kernels, so logits agree to ~1e-6 relative, not bit for bit (tests/engines).

   Weights arrive transposed ((in, out) row-major), so every projection is y[i, :] += x[i, k] * wt[k, :]: the inner
   loop runs over contiguous outputs and vectorises without reassociating any sum. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t n, hidden, hq, hk, d, experts, top_k, ffn, vocab, layers, capacity, norm_topk;
    int64_t stride_t;        /* the row length of the layers' keys_t: at least capacity + 15 (key_scores) */
    int64_t samples, prompt; /* rows i and j with i / samples == j / samples share positions < prompt of the cache */
    double eps, scaling;
    const float *embed;      /* (vocab, hidden) */
    const float *final_norm; /* (hidden) */
    const float *head_t;     /* (hidden, vocab) */
    const float *cos, *sin;  /* (capacity, d); sin carries rotate_half's sign */
    const uint8_t *attend;   /* (n, capacity), 0 = a pad key; NULL: nothing padded */
} Model;

typedef struct {
    const float *norm1;     /* (hidden) */
    const float *qkv_t;     /* (hidden, (hq + 2 hk) d) */
    const float *qk_norm;   /* (hq + hk, d) */
    const float *o_t;       /* (hq d, hidden) */
    const float *norm2;     /* (hidden) */
    const float *router_t;  /* (hidden, experts) */
    const float *gate_up_t; /* (experts, hidden, 2 ffn): [gate | up] */
    const float *down_t;    /* (experts, ffn, hidden) */
    float *keys, *values;   /* (n, hk, capacity, d): the engine's cache, written each step */
    float *keys_t;          /* (n, hk, d, stride_t): the same keys transposed, which the attention reads */
} Layer;

/* glibc's vector expf (libmvec, linked with -lmvec): declared SIMD-callable, so the loops over the softmaxes and
   the SiLU vectorise instead of calling expf per element (most of a 256-row step before). */
#pragma omp declare simd notinbranch
float expf(float);

/* y (n, out) = x (n, in) @ wt (in, out). Blocks of 4 rows x 64 outputs stay in registers (16 AVX-512 vectors)
   while k runs, so each loaded weight vector feeds 4 multiply-adds; the edges take the plain loop. */
#define BI 4
#define BJ 64
static void linear(float *restrict y, const float *restrict x, const float *restrict wt, int64_t n, int64_t in,
                   int64_t out) {
    int64_t j0 = 0;
    for (; j0 + BJ <= out; j0 += BJ) {
        int64_t i = 0;
        for (; i + BI <= n; i += BI) {
            float acc[BI][BJ] = {{0}};
            for (int64_t k = 0; k < in; k++) {
                const float *restrict w = wt + k * out + j0;
#pragma GCC unroll 4
                for (int r = 0; r < BI; r++) {
                    const float a = x[(i + r) * in + k];
#pragma omp simd
                    for (int jj = 0; jj < BJ; jj++) acc[r][jj] += a * w[jj];
                }
            }
            for (int r = 0; r < BI; r++) memcpy(y + (i + r) * out + j0, acc[r], sizeof(acc[r]));
        }
        for (; i < n; i++) {
            float acc[BJ] = {0};
            for (int64_t k = 0; k < in; k++) {
                const float a = x[i * in + k], *restrict w = wt + k * out + j0;
#pragma omp simd
                for (int jj = 0; jj < BJ; jj++) acc[jj] += a * w[jj];
            }
            memcpy(y + i * out + j0, acc, sizeof(acc));
        }
    }
    if (j0 == out) return;
    for (int64_t i = 0; i < n; i++) {
        float *restrict yi = y + i * out;
        const float *restrict xi = x + i * in;
        memset(yi + j0, 0, (size_t)(out - j0) * sizeof(float));
        for (int64_t k = 0; k < in; k++) {
            const float a = xi[k];
            const float *restrict w = wt + k * out;
            for (int64_t j = j0; j < out; j++) yi[j] += a * w[j];
        }
    }
}

/* scores[t] = scaling q . k_t for t in [t0, t1), keys transposed: kt[j * stride + t]. Blocks of 64 positions, then
   of 16, accumulate in registers over the key dimension; a last block may read up to 15 positions past t1 (each
   row of kt has room for them: stride_t >= capacity + 15, zero-filled) and writes only those before t1. */
#define SB 64
#define ST 16
static inline void key_scores(float *restrict scores, const float *restrict q, const float *restrict kt,
                              int64_t stride, int64_t t0, int64_t t1, float scaling, const int64_t d) {
    int64_t t = t0;
    for (; t + SB <= t1; t += SB) {
        float acc[SB] = {0};
        for (int64_t j = 0; j < d; j++) {
            const float qj = q[j] * scaling, *restrict k = kt + j * stride + t;
#pragma omp simd
            for (int u = 0; u < SB; u++) acc[u] += qj * k[u];
        }
        memcpy(scores + t, acc, sizeof(acc));
    }
    for (; t < t1; t += ST) { /* four partial sums over the key dimension (j mod 4): four independent chains */
        float acc[4][ST] = {{0}};
        int64_t j = 0;
        for (; j + 4 <= d; j += 4) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const float qj = q[j + r] * scaling, *restrict k = kt + (j + r) * stride + t;
#pragma omp simd
                for (int u = 0; u < ST; u++) acc[r][u] += qj * k[u];
            }
        }
        for (j = d - d % 4; j < d; j++) {
            const float qj = q[j] * scaling, *restrict k = kt + j * stride + t;
#pragma omp simd
            for (int u = 0; u < ST; u++) acc[0][u] += qj * k[u];
        }
#pragma omp simd
        for (int u = 0; u < ST; u++) acc[0][u] = (acc[0][u] + acc[1][u]) + (acc[2][u] + acc[3][u]);
        memcpy(scores + t, acc[0], sizeof(float) * (size_t)(t1 - t < ST ? t1 - t : ST));
    }
}

/* One query head's attention over `len` cached positions: keys and values of positions < prompt from the rows'
   shared prompt (kst, vs: its first sample's cache, which every sample of the prompt holds a copy of, so a group's
   rows read it from the cache while it is hot), the rest from the row's own (kot, vo). Keys come transposed ((d,
   stride) per head), so the scores accumulate one key dimension at a time over contiguous positions: vector
   multiply-adds with no per-position horizontal sum. The value sum keeps four partial sums (positions mod 4) to
   overlap the multiply-add latency. fp32 scores and softmax, pad keys (keep[t] == 0) weigh exactly 0. */
static inline void head_attention(float *restrict o, const float *restrict q, const float *kst, const float *vs,
                                  const float *kot, const float *vo, int64_t prompt, int64_t len, int64_t stride,
                                  const uint8_t *keep, float scaling, float *restrict scores, const int64_t d) {
    const int64_t shared = prompt < len ? prompt : len;
    key_scores(scores, q, kst, stride, 0, shared, scaling, d);
    key_scores(scores, q, kot, stride, shared, len, scaling, d);
    float mx = -INFINITY;
    if (keep) {
        for (int64_t t = 0; t < len; t++)
            if (keep[t] && scores[t] > mx) mx = scores[t];
    } else {
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; t++) mx = scores[t] > mx ? scores[t] : mx;
    }
    float total = 0.0f;
    if (keep) {
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            const float p = keep[t] ? expf(scores[t] - mx) : 0.0f;
            scores[t] = p;
            total += p;
        }
    } else {
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) total += (scores[t] = expf(scores[t] - mx));
    }
    const float inv = 1.0f / total;
    /* o = sum_t p_t v_t: 16 dimensions at a time, four partial sums over the positions (t mod 4) in registers. Pad
       keys weigh exactly 0 and their values are finite (the prefill's, for the pad token), as in torch's masked
       attention, whose weights multiply every value. */
#define VALUE_ROW(t) (((t) < prompt ? vs : vo) + (t) * d)
    int64_t j0 = 0;
    for (; j0 + ST <= d; j0 += ST) {
        float acc[4][ST] = {{0}};
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const float p = scores[t + r], *restrict v = VALUE_ROW(t + r) + j0;
#pragma omp simd
                for (int u = 0; u < ST; u++) acc[r][u] += p * v[u];
            }
        }
        for (; t < len; t++) {
            const float p = scores[t], *restrict v = VALUE_ROW(t) + j0;
#pragma omp simd
            for (int u = 0; u < ST; u++) acc[0][u] += p * v[u];
        }
#pragma omp simd
        for (int u = 0; u < ST; u++) o[j0 + u] = ((acc[0][u] + acc[1][u]) + (acc[2][u] + acc[3][u])) * inv;
    }
    for (j0 = d - d % ST; j0 < d; j0++) { /* head sizes that are not a multiple of 16 */
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) sum += scores[t] * VALUE_ROW(t)[j0];
        o[j0] = sum * inv;
    }
#undef VALUE_ROW
}

/* Qwen3MoeRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, over rows of `width`; row i's weight is w + i * w_stride
   (0: one weight for all rows) */
static void rms(float *y, const float *x, const float *w, int64_t w_stride, int64_t rows, int64_t width, double eps) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * width, *wi = w + i * w_stride;
        float *yi = y + i * width;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < width; j++) ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / (float)width + (float)eps);
        for (int64_t j = 0; j < width; j++) yi[j] = wi[j] * (xi[j] * r);
    }
}

/* Logits (n, vocab) of the next token after tokens `tok` (n) at positions `pos` (n); the step's keys and values go
   to cache slot `slot` (the same for every row: left padding aligns the rows). Expert indices (layers, n, top_k)
   to `routes` if not NULL. Returns 0, or -1 if a workspace could not be allocated. */
int qwen3_moe_decode_step(const Model *m, const Layer *layers, const int64_t *tok, const int64_t *pos, int64_t slot,
                          float *logits, int64_t *routes) {
    const int64_t n = m->n, H = m->hidden, d = m->d, hq = m->hq, hk = m->hk, E = m->experts, K = m->top_k;
    const int64_t F = m->ffn, C = m->capacity, CT = m->stride_t, QKV = (hq + 2 * hk) * d, group = hq / hk;
    const int64_t len = slot + 1; /* cached positions after this step */
    float *x = malloc(sizeof(float) * n * H), *h = malloc(sizeof(float) * n * H);
    float *qkv = malloc(sizeof(float) * n * QKV), *attn = malloc(sizeof(float) * n * hq * d);
    float *tmp = malloc(sizeof(float) * n * (H > E ? H : E)), *scores = malloc(sizeof(float) * len);
    float *gu = malloc(sizeof(float) * n * K * 2 * F), *act = malloc(sizeof(float) * n * K * F);
    float *xe = malloc(sizeof(float) * n * K * H), *eo = malloc(sizeof(float) * n * K * H);
    float *moe = malloc(sizeof(float) * n * K * H), *roped = malloc(sizeof(float) * d);
    int64_t *top_i = malloc(sizeof(int64_t) * n * K), *sel = malloc(sizeof(int64_t) * n * K);
    float *top_w = malloc(sizeof(float) * n * K);
    int rc = 0;
    if (!x || !h || !qkv || !attn || !tmp || !scores || !gu || !act || !xe || !eo || !moe || !roped || !top_i || !sel ||
        !top_w) {
        rc = -1;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) memcpy(x + i * H, m->embed + tok[i] * H, sizeof(float) * H);

    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *L = layers + l;
        /* attention: norm, one GEMM for q/k/v, per-head q/k norms, RoPE, cache write, grouped attention */
        rms(h, x, L->norm1, 0, n, H, m->eps);
        linear(qkv, h, L->qkv_t, n, H, QKV);
        for (int64_t i = 0; i < n; i++) {
            float *row = qkv + i * QKV;
            rms(row, row, L->qk_norm, d, hq + hk, d, m->eps); /* q heads, then k heads: each its row of qk_norm */
            const float *c = m->cos + pos[i] * d, *s = m->sin + pos[i] * d;
            const int64_t half = d / 2; /* rotate_half: the first half reads the second, negated by sin's sign */
            for (int64_t head = 0; head < hq + hk; head++) {
                float *v = row + head * d;
#pragma omp simd
                for (int64_t j = 0; j < half; j++) roped[j] = v[j] * c[j] + v[j + half] * s[j];
#pragma omp simd
                for (int64_t j = half; j < d; j++) roped[j] = v[j] * c[j] + v[j - half] * s[j];
                memcpy(v, roped, sizeof(float) * d);
            }
            for (int64_t g = 0; g < hk; g++) {
                const int64_t at = ((i * hk + g) * C + slot) * d;
                memcpy(L->keys + at, row + (hq + g) * d, sizeof(float) * d);
                memcpy(L->values + at, row + (hq + hk + g) * d, sizeof(float) * d);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *keep = m->attend ? m->attend + i * C : NULL;
            const int64_t lead = i / m->samples * m->samples; /* the row whose prompt keys this row shares */
            for (int64_t g = 0; g < hk; g++) { /* this step's keys, transposed, just before the row reads them */
                float *kt = L->keys_t + (i * hk + g) * d * CT + slot;
                const float *k = qkv + i * QKV + (hq + g) * d;
                for (int64_t j = 0; j < d; j++) kt[j * CT] = k[j];
            }
            if (i + 1 < n) /* the next row's own keys and values towards L2 while this row computes: the cache
                              outgrows L2 at a few hundred rows, and each row's few KB are too short a stream for
                              the hardware prefetcher (generate at 256 rows x 64 tokens: -12%) */
                for (int64_t g = 0; g < hk; g++) {
                    const float *kn = L->keys_t + ((i + 1) * hk + g) * d * CT;
                    const float *vn = L->values + ((i + 1) * hk + g) * C * d;
                    const int64_t from = m->prompt < len ? m->prompt : len;
                    for (int64_t j = 0; j < d; j++)
                        for (int64_t t = from; t < len; t += 16) __builtin_prefetch(kn + j * CT + t, 0, 2);
                    for (int64_t t = from * d; t < len * d; t += 16) __builtin_prefetch(vn + t, 0, 2);
                }
            for (int64_t head = 0; head < hq; head++) {
                const int64_t g = head / group, own = (i * hk + g) * C * d, shared = (lead * hk + g) * C * d;
                const int64_t own_t = (i * hk + g) * d * CT, shared_t = (lead * hk + g) * d * CT;
                float *o = attn + (i * hq + head) * d;
                const float *q = qkv + i * QKV + head * d, sc = (float)m->scaling;
                const float *ks = L->keys_t + shared_t, *vs = L->values + shared, *ko = L->keys_t + own_t;
                const float *vo = L->values + own;
                if (d == 32) /* the common head sizes get loops of a known length */
                    head_attention(o, q, ks, vs, ko, vo, m->prompt, len, CT, keep, sc, scores, 32);
                else if (d == 64)
                    head_attention(o, q, ks, vs, ko, vo, m->prompt, len, CT, keep, sc, scores, 64);
                else if (d == 128)
                    head_attention(o, q, ks, vs, ko, vo, m->prompt, len, CT, keep, sc, scores, 128);
                else
                    head_attention(o, q, ks, vs, ko, vo, m->prompt, len, CT, keep, sc, scores, d);
            }
        }
        linear(tmp, attn, L->o_t, n, hq * d, H);
        for (int64_t j = 0; j < n * H; j++) x[j] += tmp[j];

        /* MoE: norm, router softmax and top-k, the chosen experts' SwiGLU MLPs weighted by the gates */
        rms(h, x, L->norm2, 0, n, H, m->eps);
        linear(tmp, h, L->router_t, n, H, E);
        for (int64_t i = 0; i < n; i++) {
            float *p = tmp + i * E, mx = -INFINITY, total = 0.0f, chosen = 0.0f;
            for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
            for (int64_t e = 0; e < E; e++) total += (p[e] = expf(p[e] - mx));
            for (int64_t e = 0; e < E; e++) p[e] /= total;
            for (int64_t k = 0; k < K; k++) { /* descending, the lower index first among equals (as torch.topk) */
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    int taken = 0;
                    for (int64_t j = 0; j < k; j++) taken |= top_i[i * K + j] == e;
                    if (!taken && (best < 0 || p[e] > p[best])) best = e;
                }
                top_i[i * K + k] = best;
                top_w[i * K + k] = p[best];
                chosen += p[best];
            }
            if (m->norm_topk)
                for (int64_t k = 0; k < K; k++) top_w[i * K + k] /= chosen;
        }
        if (routes) memcpy(routes + l * n * K, top_i, sizeof(int64_t) * n * K);
        for (int64_t e = 0; e < E; e++) { /* expert by expert: gather its rows, two GEMMs, scatter */
            int64_t rows = 0;
            for (int64_t r = 0; r < n * K; r++)
                if (top_i[r] == e) {
                    sel[rows] = r;
                    memcpy(xe + rows * H, h + (r / K) * H, sizeof(float) * H);
                    rows++;
                }
            if (!rows) continue;
            linear(gu, xe, L->gate_up_t + e * H * 2 * F, rows, H, 2 * F);
            for (int64_t r = 0; r < rows; r++) {
                const float *g = gu + r * 2 * F;
                float *a = act + r * F;
#pragma omp simd
                for (int64_t j = 0; j < F; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * g[F + j];
            }
            linear(eo, act, L->down_t + e * F * H, rows, F, H);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < H; j++) moe[sel[r] * H + j] = eo[r * H + j] * top_w[sel[r]];
        }
        for (int64_t i = 0; i < n; i++) {
            for (int64_t j = 0; j < H; j++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < K; k++) sum += moe[(i * K + k) * H + j];
                x[i * H + j] += sum;
            }
        }
    }
    rms(h, x, m->final_norm, 0, n, H, m->eps);
    linear(logits, h, m->head_t, n, H, m->vocab);
done:
    free(x), free(h), free(qkv), free(attn), free(tmp), free(scores), free(gu), free(act), free(eo), free(moe);
    free(roped), free(top_i), free(top_w), free(xe), free(sel);
    return rc;
}

/* One token per row of `logits` (n, vocab) and its log-probability under the distribution it was drawn from
   (softmax(logits / temperature); at temperature 0 or 1 log_softmax(logits)): the engine's `sample` (inverse CDF,
   one uniform `u` per row from the engine's torch generator) on the same uniforms. At `temperature` 0 the first
   maximum; otherwise the first index whose cumulative weight (fp64) exceeds u x the total, where the weights are
   exp((x - max) / temperature): softmax's numerators, so the distribution is exactly softmax(logits / temperature).
   Returns 0, or -1 if a workspace could not be allocated. */
int qwen3_moe_sample(const float *logits, int64_t n, int64_t vocab, const double *u, double temperature,
                     int64_t *tok, float *lp) {
    float *w = malloc(sizeof(float) * vocab);
    if (!w) return -1;
    for (int64_t i = 0; i < n; i++) {
        const float *x = logits + i * vocab;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t v = 0; v < vocab; v++) mx = x[v] > mx ? x[v] : mx;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t v = 0; v < vocab; v++) total += expf(x[v] - mx);
        const float lse = mx + logf(total);
        int64_t t = 0;
        float tempered = NAN; /* the draw's log-probability at temperature != 1 */
        if (temperature > 0) {
            const float inv = (float)(1.0 / temperature);
            double sum = 0.0;
#pragma omp simd reduction(+ : sum)
            for (int64_t v = 0; v < vocab; v++) sum += (w[v] = expf((x[v] - mx) * inv));
            const double target = u[i] * sum;
            /* the first index whose cumulative weight exceeds target: skip whole blocks of 16, then scan one */
            double cdf = 0.0;
            int64_t v = 0;
            for (; v + 16 <= vocab; v += 16) {
                double block = 0.0;
#pragma omp simd reduction(+ : block)
                for (int64_t j = v; j < v + 16; j++) block += w[j];
                if (cdf + block > target) break;
                cdf += block;
            }
            t = -1;
            for (; v < vocab; v++) {
                cdf += w[v];
                if (cdf > target) {
                    t = v;
                    break;
                }
            }
            if (t < 0) /* target within rounding of the total: the last token with weight (as torch's clamp) */
                for (t = vocab - 1; t > 0 && w[t] == 0.0f; t--) {
                }
            if (temperature != 1.0) tempered = (float)((double)((x[t] - mx) * inv) - log(sum));
        } else {
            while (x[t] != mx) t++; /* the first maximum, as argmax */
        }
        tok[i] = t;
        lp[i] = temperature > 0 && temperature != 1.0 ? tempered : x[t] - lse;
    }
    free(w);
    return 0;
}

/* The hf engine's whole sampling loop after the prefill, for its n rows: sample from `logits` (the prefill's, (n,
   vocab)) with uniforms u[step] (max_new x n, drawn up front from the engine's generator: the same numbers the torch
   loop draws one step at a time), record the token and its log-prob, stop a row at a stop token, and decode the next
   step (positions pos + 1, cache slot `slot` + step) until every row has stopped or max_new tokens are out. Writes
   tokens and lps (n, max_new; columns past the returned count are unset), length (response tokens per row, the
   stop included), done (1 = stopped), routes ((max_new - 1, layers, n, top_k) of the decode steps, if not NULL);
   `logits` is overwritten. Returns the number of tokens sampled per row, or -1 on a failed allocation. */
int64_t qwen3_moe_generate(const Model *m, const Layer *layers, float *logits, int64_t *pos, int64_t slot,
                           const double *u, double temperature, const int64_t *stops, int64_t n_stops,
                           int64_t max_new, int64_t *tokens, float *lps, int64_t *length, uint8_t *done,
                           int64_t *routes) {
    const int64_t n = m->n;
    int64_t *tok = malloc(sizeof(int64_t) * n);
    float *lp = malloc(sizeof(float) * n);
    int64_t steps = -1;
    if (!tok || !lp) goto out;
    for (int64_t i = 0; i < n; i++) length[i] = 0, done[i] = 0;
    for (int64_t step = 0; step < max_new; step++) {
        if (qwen3_moe_sample(logits, n, m->vocab, u + step * n, temperature, tok, lp)) goto out;
        int all = 1;
        for (int64_t i = 0; i < n; i++) {
            tokens[i * max_new + step] = tok[i];
            lps[i * max_new + step] = lp[i];
            length[i] += !done[i];
            for (int64_t s = 0; s < n_stops && !done[i]; s++) done[i] = tok[i] == stops[s];
            all &= done[i];
        }
        if (all || step == max_new - 1) {
            steps = step + 1;
            break;
        }
        for (int64_t i = 0; i < n; i++) pos[i] += 1;
        int64_t *r = routes ? routes + step * m->layers * n * m->top_k : NULL;
        if (qwen3_moe_decode_step(m, layers, tok, pos, slot + step, logits, r)) goto out;
    }
out:
    free(tok), free(lp);
    return steps;
}
