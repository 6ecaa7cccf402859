/* RMSNorm forward and backward over rows (fp32, CPU) for the policy's norms: study/kernels/rms_norm.py calls them.

   torch's CPU RMSNorm is composite: pow, mean, add, rsqrt and two multiplies forward, about twice as many ops
   backward, each a pass over the activations; here each direction is one pass per row. Sums run in another order
   than torch's, so results agree to ~1e-6 relative, not bit for bit (tests/kernels). */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* y = x * rsqrt(mean(x^2) + eps) * w over `rows` rows of `d`; each row's rsqrt to `rstd` (for the backward) */
void rms_forward(const float *restrict x, const float *restrict w, int64_t rows, int64_t d, double eps,
                 float *restrict y, float *restrict rstd) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * d;
        float *yi = y + i * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; j++) ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / (float)d + (float)eps);
        rstd[i] = r;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) yi[j] = (xi[j] * r) * w[j];
    }
}
/* With xhat = x * r (r = the row's rstd): dx = r * (g w - xhat * mean(g w xhat)) and dw = sum over rows of
   g * xhat (rows in order, so the sum is deterministic) */
void rms_backward(const float *restrict g, const float *restrict x, const float *restrict w,
                  const float *restrict rstd, int64_t rows, int64_t d, float *restrict dx, float *restrict dw) {
    memset(dw, 0, sizeof(float) * d);
    for (int64_t i = 0; i < rows; i++) {
        const float *gi = g + i * d, *xi = x + i * d;
        float *dxi = dx + i * d;
        const float r = rstd[i];
        float c = 0.0f;
#pragma omp simd reduction(+ : c)
        for (int64_t j = 0; j < d; j++) c += gi[j] * w[j] * (xi[j] * r);
        c /= (float)d;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) {
            const float xh = xi[j] * r;
            dxi[j] = r * (gi[j] * w[j] - xh * c);
            dw[j] += gi[j] * xh;
        }
    }
}
