/* One decode step of a Qwen3-MoE decoder (fp32, CPU) for the hf engine: study/engines/native.py builds and calls it.

   The same arithmetic as transformers' Qwen3MoeForCausalLM decode step with the engine's grouped decode attention
   and the `grouped_mm` experts (study/engines/hf.py `_FusedDecoder`), in one call instead of ~190 torch ops: at the
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
    float *keys, *values;   /* (n, hk, capacity, d) */
} Layer;

/* e^x for x <= 88, 0 below -87 (-inf included), to ~2 ulp: x = k ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial of
   e^r, times 2^k by the exponent bits. libm's expf is a call per element (the SiLU and the softmaxes spent most of
   a 256-row step in it); this one vectorises in the loops that use it. */
static inline float fexp(float x) {
    const float in = x;
    x = x < -87.0f ? -87.0f : x;
    const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f; /* ln2 split: exact k * hi */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)k + 127) << 23};
    return in < -87.0f ? 0.0f : p * scale.f; /* below e^-87 (and -inf): 0, so a masked weight is exactly 0 */
}

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
    const int64_t F = m->ffn, C = m->capacity, QKV = (hq + 2 * hk) * d, group = hq / hk;
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
            for (int64_t head = 0; head < hq + hk; head++) {
                float *v = row + head * d;
                for (int64_t j = 0; j < d; j++) roped[j] = v[j] * c[j] + v[(j + d / 2) % d] * s[j];
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
            for (int64_t head = 0; head < hq; head++) {
                const int64_t g = head / group;
                const float *q = qkv + i * QKV + head * d;
                const float *kc = L->keys + (i * hk + g) * C * d, *vc = L->values + (i * hk + g) * C * d;
                float mx = -INFINITY;
                for (int64_t t = 0; t < len; t++) {
                    const float *kt = kc + t * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t j = 0; j < d; j++) dot += q[j] * kt[j];
                    scores[t] = dot * (float)m->scaling;
                    if ((!keep || keep[t]) && scores[t] > mx) mx = scores[t];
                }
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < len; t++) {
                    const float p = (!keep || keep[t]) ? fexp(scores[t] - mx) : 0.0f; /* a pad key weighs 0 */
                    scores[t] = p;
                    total += p;
                }
                float *o = attn + (i * hq + head) * d;
                memset(o, 0, sizeof(float) * d);
                for (int64_t t = 0; t < len; t++) {
                    if (scores[t] == 0.0f) continue; /* pad keys (their values may be anything) */
                    const float p = scores[t] / total, *vt = vc + t * d;
                    for (int64_t j = 0; j < d; j++) o[j] += p * vt[j];
                }
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
            for (int64_t e = 0; e < E; e++) total += (p[e] = fexp(p[e] - mx));
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
                for (int64_t j = 0; j < F; j++) a[j] = g[j] / (1.0f + fexp(-g[j])) * g[F + j];
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

/* One token per row of `logits` (n, vocab) and its untempered log-probability: the engine's `sample` (inverse CDF,
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
        int64_t arg = 0;
        for (int64_t v = 0; v < vocab; v++)
            if (x[v] > mx) mx = x[v], arg = v;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t v = 0; v < vocab; v++) total += fexp(x[v] - mx);
        const float lse = mx + logf(total);
        int64_t t = arg;
        if (temperature > 0) {
            const float inv = (float)(1.0 / temperature);
#pragma omp simd
            for (int64_t v = 0; v < vocab; v++) w[v] = fexp((x[v] - mx) * inv);
            double sum = 0.0;
            for (int64_t v = 0; v < vocab; v++) sum += w[v];
            const double target = u[i] * sum;
            double cdf = 0.0;
            t = vocab - 1;
            for (int64_t v = 0; v < vocab; v++) {
                cdf += w[v];
                if (cdf > target) {
                    t = v;
                    break;
                }
            }
        }
        tok[i] = t;
        lp[i] = x[t] - lse;
    }
    free(w);
    return 0;
}
