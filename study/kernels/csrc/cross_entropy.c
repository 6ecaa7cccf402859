/* Cross entropy over the vocabulary, forward and backward (fp32, CPU), for the policy's language-model loss:
   study/kernels/cross_entropy.py builds and calls it.

   loss_r = log(sum_v exp(x_rv - max_r)) - (x_r,t_r - max_r) for each row r of logits x (rows, V) and its target
   t_r, the terms of megatron's vocab-parallel cross entropy in one pass over the row (megatron's makes five: max,
   subtract, exp, sum, gather), and the backward's (softmax_r - onehot(t_r)) * g_r in one more. Sums run in another
   order and exp is glibc's vector expf: losses agree with megatron's to ~1e-6, not bit for bit (tests/study). */

#include <math.h>
#include <stdint.h>

#pragma omp declare simd notinbranch
float expf(float);

/* loss (rows) and the rows' log-sum-exp lse (rows), which the backward reuses. */
void ce_forward(const float *restrict x, const int64_t *restrict target, int64_t rows, int64_t V, float *restrict loss,
                float *restrict lse) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * V;
        float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t v = 0; v < V; v++) mx = xr[v] > mx ? xr[v] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t v = 0; v < V; v++) sum += expf(xr[v] - mx);
        const float log_sum = logf(sum);
        loss[r] = log_sum - (xr[target[r]] - mx);
        lse[r] = mx + log_sum;
    }
}

/* dx (rows, V) = (exp(x - lse) - onehot(target)) * g, g (rows) the loss's gradient. */
void ce_backward(const float *restrict x, const int64_t *restrict target, const float *restrict lse,
                 const float *restrict g, int64_t rows, int64_t V, float *restrict dx) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * V, l = lse[r], gr = g[r];
        float *o = dx + r * V;
#pragma omp simd
        for (int64_t v = 0; v < V; v++) o[v] = expf(xr[v] - l) * gr;
        o[target[r]] -= gr;
    }
}
