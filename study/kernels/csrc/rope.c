/* Rotary position embedding (non-interleaved, rotate_half), forward and backward (fp32, CPU), for megatron's fused-RoPE
   slot: study/kernels/rope.py builds and calls it.

   y = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] over the two halves of the head dimension, for
   x (S, R, d): R rows (batch x heads) per position s, whose cos and sin rows (d) are cos[s] and sin[s]. Each element
   is the same two products and one sum as megatron's unfused torch code (multiplications, then the sum, each rounded
   to fp32), so results are bit for bit torch's: contraction into fused multiply-adds is off in this file. */

#include <stdint.h>

#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

void rope_forward(const float *restrict x, const float *restrict cos, const float *restrict sin, int64_t S, int64_t R,
                  int64_t d, float *restrict y) {
    const int64_t h = d / 2;
    for (int64_t s = 0; s < S; s++) {
        const float *c = cos + s * d, *sn = sin + s * d;
        for (int64_t r = 0; r < R; r++) {
            const float *xr = x + (s * R + r) * d;
            float *yr = y + (s * R + r) * d;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) yr[j] = xr[j] * c[j] + (-xr[j + h]) * sn[j];
#pragma omp simd
            for (int64_t j = h; j < d; j++) yr[j] = xr[j] * c[j] + xr[j - h] * sn[j];
        }
    }
}

/* dx from dy: the transpose of the forward, dx1 = dy1 cos1 + dy2 sin2 and dx2 = dy2 cos2 - dy1 sin1 (the sums
   torch's autograd forms). */
void rope_backward(const float *restrict dy, const float *restrict cos, const float *restrict sin, int64_t S,
                   int64_t R, int64_t d, float *restrict dx) {
    const int64_t h = d / 2;
    for (int64_t s = 0; s < S; s++) {
        const float *c = cos + s * d, *sn = sin + s * d;
        for (int64_t r = 0; r < R; r++) {
            const float *g = dy + (s * R + r) * d;
            float *o = dx + (s * R + r) * d;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) o[j] = g[j] * c[j] + g[j + h] * sn[j + h];
#pragma omp simd
            for (int64_t j = h; j < d; j++) o[j] = g[j] * c[j] + (-(g[j - h] * sn[j - h]));
        }
    }
}
