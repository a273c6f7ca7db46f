/* FIRE's per-pair bias on the CPU, fused: the normalised distance, its segment of the MLP's
 * piecewise-linear form, and every head's value, in one pass over the pairs (forward), and the
 * gradients of the four small tensors the bias is made from in one more (backward). The math is
 * relpos/functional/fire.py's; relpos/native/__init__.py builds this file and
 * relpos/functional/fire.py calls it.
 *
 * Shapes (C order, float32 unless said): positions int64, one row of I queries (J keys) per batch
 * entry at a stride of q_bs (k_bs) elements, 0 when the batch shares them; inv = 1 / (psi(max(L,
 * p_i)) + eps), laid out like the queries; psi (D,) = log(1 + c*d) for d = 0 .. D-1; kinks (M,)
 * sorted; slope, icpt (H, M + 1); out and grad (B, H, I, J) contiguous. A pair's distance is
 * max(p_i - p_j, 0), its input x = psi[d] * inv_i, its segment s = #{k : kinks[k] <= x}.
 */
#include <stdint.h>

static inline int64_t distance(int64_t pi, int64_t pj) {
    int64_t d = pi - pj;
    return d > 0 ? d : 0;
}

enum { PIECE = 2048, LANES = 8 };

/* One piece of a query's row: x[j] and s[j] of n keys, and the runs of equal segments (run r is
 * keys start[r] .. start[r + 1] - 1; neighbouring keys mostly share a segment, their distances
 * differ by one, so a row has few runs). Returns the number of runs. */
static int64_t inputs(int64_t pi, float r, const int64_t *krow, int64_t n, const float *psi,
                      const float *kinks, int64_t M, float *x, uint8_t *s, int32_t *start) {
    int32_t count[PIECE]; /* int32 lanes match the float compares: the loops vectorise */
    for (int64_t j = 0; j < n; j++) x[j] = psi[distance(pi, krow[j])] * r;
    for (int64_t j = 0; j < n; j++) count[j] = 0;
    for (int64_t k = 0; k < M; k++) {
        const float t = kinks[k];
        for (int64_t j = 0; j < n; j++) count[j] += x[j] >= t;
    }
    for (int64_t j = 0; j < n; j++) s[j] = (uint8_t)count[j];
    int64_t runs = 0;
    for (int64_t j = 0; j < n; j++)
        if (j == 0 || s[j] != s[j - 1]) start[runs++] = (int32_t)j;
    start[runs] = (int32_t)n;
    return runs;
}

/* out = slope[h, s] * x + icpt[h, s], added to out when accumulate is non-zero. */
void relpos_fire_forward(const int64_t *qp, int64_t q_bs, const int64_t *kp, int64_t k_bs,
                         const float *inv, int64_t B, int64_t I, int64_t J, int64_t H,
                         const float *psi, const float *kinks, int64_t M, const float *slope,
                         const float *icpt, float *out, int64_t accumulate) {
    float x[PIECE];
    uint8_t s[PIECE];
    int32_t start[PIECE + 1];
    const int64_t S = M + 1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < I; i++) {
            const int64_t pi = qp[b * q_bs + i];
            const float r = inv[b * q_bs + i];
            for (int64_t j0 = 0; j0 < J; j0 += PIECE) {
                const int64_t n = J - j0 < PIECE ? J - j0 : PIECE;
                const int64_t R = inputs(pi, r, kp + b * k_bs + j0, n, psi, kinks, M, x, s, start);
                for (int64_t h = 0; h < H; h++) {
                    float *orow = out + ((b * H + h) * I + i) * J + j0;
                    for (int64_t q = 0; q < R; q++) {
                        const float a = slope[h * S + s[start[q]]], c = icpt[h * S + s[start[q]]];
                        if (accumulate)
                            for (int64_t j = start[q]; j < start[q + 1]; j++) orow[j] += a * x[j] + c;
                        else
                            for (int64_t j = start[q]; j < start[q + 1]; j++) orow[j] = a * x[j] + c;
                    }
                }
            }
        }
    }
}

/* Given grad (B, H, I, J) of the output, adds the gradients of the inputs: of icpt and slope
 * (gicpt, gslope (H, M + 1): per head and segment the sums of g and of g * x), and, with
 * gx = sum_h g * slope[h, s] the gradient of x, of each psi entry (gpsi (D,), gx * inv_i) and of
 * each inv_i (ginv, laid out like inv: sum_j gx * psi[d]). A run sums in LANES float
 * accumulators, added into the double totals at its end. */
void relpos_fire_backward(const int64_t *qp, int64_t q_bs, const int64_t *kp, int64_t k_bs,
                          const float *inv, int64_t B, int64_t I, int64_t J, int64_t H,
                          const float *psi, const float *kinks, int64_t M, const float *slope,
                          const float *grad, double *gslope, double *gicpt, double *gpsi,
                          double *ginv) {
    float x[PIECE], gx[PIECE];
    uint8_t s[PIECE];
    int32_t start[PIECE + 1];
    const int64_t S = M + 1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < I; i++) {
            const int64_t pi = qp[b * q_bs + i];
            const float r = inv[b * q_bs + i];
            const int64_t *krow = kp + b * k_bs;
            double row = 0.0;
            for (int64_t j0 = 0; j0 < J; j0 += PIECE) {
                const int64_t n = J - j0 < PIECE ? J - j0 : PIECE;
                const int64_t R = inputs(pi, r, krow + j0, n, psi, kinks, M, x, s, start);
                for (int64_t j = 0; j < n; j++) gx[j] = 0.0f;
                for (int64_t h = 0; h < H; h++) {
                    const float *g = grad + ((b * H + h) * I + i) * J + j0;
                    for (int64_t q = 0; q < R; q++) {
                        const int64_t seg = s[start[q]], end = start[q + 1];
                        const float k = slope[h * S + seg];
                        float acc_g[LANES] = {0}, acc_gx[LANES] = {0};
                        int64_t j = start[q];
                        for (; j + LANES <= end; j += LANES)
                            for (int l = 0; l < LANES; l++) {
                                acc_g[l] += g[j + l];
                                acc_gx[l] += g[j + l] * x[j + l];
                                gx[j + l] += g[j + l] * k;
                            }
                        float tail_g = 0.0f, tail_gx = 0.0f;
                        for (; j < end; j++) {
                            tail_g += g[j];
                            tail_gx += g[j] * x[j];
                            gx[j] += g[j] * k;
                        }
                        double tg = tail_g, tgx = tail_gx;
                        for (int l = 0; l < LANES; l++) {
                            tg += acc_g[l];
                            tgx += acc_gx[l];
                        }
                        gicpt[h * S + seg] += tg;
                        gslope[h * S + seg] += tgx;
                    }
                }
                for (int64_t j = 0; j < n; j++) {
                    const int64_t d = distance(pi, krow[j0 + j]);
                    gpsi[d] += (double)gx[j] * r;
                    row += (double)gx[j] * psi[d];
                }
            }
            ginv[b * q_bs + i] += row;
        }
    }
}
