/* FIRE's per-pair bias on the CPU, fused: the normalised distance, its segment of the MLP's
 * piecewise-linear form, and every head's value, in one pass over the pairs (forward), and the
 * per-segment gradient sums in one more (backward). The math is relpos/functional/fire.py's;
 * relpos/native/__init__.py builds this file and relpos/functional/fire.py calls it.
 *
 * Shapes (C order, float32 unless said): positions int64 (b|1, I) and (b|1, J) (batch stride 0
 * when shared); inv (b|1, I) = 1 / (psi(max(L, p_i)) + eps), strided like the queries; psi (D,)
 * = log(1 + c*d) for d = 0 .. D-1; kinks (M,) sorted; slope, icpt (H, M + 1). A pair's distance
 * is max(p_i - p_j, 0), its input x = psi[d] * inv_i, its segment s = #{k : kinks[k] <= x}.
 */
#include <stdint.h>

static inline int64_t distance(int64_t pi, int64_t pj) {
    int64_t d = pi - pj;
    return d > 0 ? d : 0;
}

enum { PIECE = 2048, LANES = 8 };

/* x[j] and s[j] of keys j0 .. j0 + n - 1 of one query. */
static void inputs(int64_t pi, float r, const int64_t *krow, int64_t n, const float *psi,
                   const float *kinks, int64_t M, float *x, uint8_t *s) {
    int32_t count[PIECE]; /* int32 lanes match the float compares: the loops vectorise */
    for (int64_t j = 0; j < n; j++) x[j] = psi[distance(pi, krow[j])] * r;
    for (int64_t j = 0; j < n; j++) count[j] = 0;
    for (int64_t k = 0; k < M; k++) {
        const float t = kinks[k];
        for (int64_t j = 0; j < n; j++) count[j] += x[j] >= t;
    }
    for (int64_t j = 0; j < n; j++) s[j] = (uint8_t)count[j];
}

/* The runs of equal segments among n keys: run r is keys start[r] .. start[r + 1] - 1.
 * Neighbouring keys mostly share a segment (their distances differ by one), so a row has few
 * runs. */
static int64_t runs(const uint8_t *s, int64_t n, int32_t *start) {
    int64_t count = 0;
    for (int64_t j = 0; j < n; j++)
        if (j == 0 || s[j] != s[j - 1]) start[count++] = (int32_t)j;
    start[count] = (int32_t)n;
    return count;
}

/* out (B, H, I, J): slope[h, s] * x + icpt[h, s]; seg (B, I, J): s. A row is processed in
 * pieces of PIECE keys staged on the stack; within a run one slope and intercept apply. */
void relpos_fire_forward(const int64_t *qp, int64_t q_bs, const int64_t *kp, int64_t k_bs,
                         const float *inv, int64_t B, int64_t I, int64_t J, int64_t H,
                         const float *psi, const float *kinks, int64_t M, const float *slope,
                         const float *icpt, float *out, uint8_t *seg) {
    float x[PIECE];
    int32_t start[PIECE + 1];
    const int64_t S = M + 1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < I; i++) {
            const int64_t pi = qp[b * q_bs + i];
            const float r = inv[b * q_bs + i];
            for (int64_t j0 = 0; j0 < J; j0 += PIECE) {
                const int64_t n = J - j0 < PIECE ? J - j0 : PIECE;
                uint8_t *s = seg + (b * I + i) * J + j0;
                inputs(pi, r, kp + b * k_bs + j0, n, psi, kinks, M, x, s);
                const int64_t R = runs(s, n, start);
                for (int64_t h = 0; h < H; h++) {
                    float *orow = out + ((b * H + h) * I + i) * J + j0;
                    for (int64_t q = 0; q < R; q++) {
                        const float a = slope[h * S + s[start[q]]], c = icpt[h * S + s[start[q]]];
                        for (int64_t j = start[q]; j < start[q + 1]; j++) orow[j] = a * x[j] + c;
                    }
                }
            }
        }
    }
}

/* Given grad (B, H, I, J) of the output: per head and segment the sums of g and of g * x
 * (sums (2, H, M + 1)); with gx = sum_h g * slope[h, s] the gradient of x, the gradient of each
 * psi entry (gpsi (D,), += gx * inv_i) and of each inv_i (ginv (B, I), sum_j gx * psi[d]).
 * Neighbouring keys mostly share a segment, so the sums run over blocks of LANES keys of one
 * segment with one accumulator per lane (near a segment's end, key by key), added into the
 * double totals when the segment changes. The outputs must be zeroed by the
 * caller. */
void relpos_fire_backward(const int64_t *qp, int64_t q_bs, const int64_t *kp, int64_t k_bs,
                          const float *inv, int64_t B, int64_t I, int64_t J, int64_t H,
                          const float *psi, const float *slope, int64_t M, const uint8_t *seg,
                          const float *grad, double *sums, double *gpsi, double *ginv) {
    float x[PIECE], gx[PIECE];
    int32_t left[PIECE];
    const int64_t S = M + 1;
    double *sum_g = sums, *sum_gx = sums + H * S;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < I; i++) {
            const int64_t pi = qp[b * q_bs + i];
            const float r = inv[b * q_bs + i];
            const int64_t *krow = kp + b * k_bs;
            double row = 0.0;
            for (int64_t j0 = 0; j0 < J; j0 += PIECE) {
                const int64_t n = J - j0 < PIECE ? J - j0 : PIECE;
                const uint8_t *s = seg + (b * I + i) * J + j0;
                left[n - 1] = 1; /* keys from j on in s[j]'s segment, j included */
                for (int64_t j = n - 2; j >= 0; j--)
                    left[j] = s[j] == s[j + 1] ? left[j + 1] + 1 : 1;
                for (int64_t j = 0; j < n; j++) x[j] = psi[distance(pi, krow[j0 + j])] * r;
                for (int64_t j = 0; j < n; j++) gx[j] = 0.0f;
                for (int64_t h = 0; h < H; h++) {
                    const float *g = grad + ((b * H + h) * I + i) * J + j0;
                    const float *sl = slope + h * S;
                    float acc_g[LANES] = {0}, acc_gx[LANES] = {0};
                    int64_t cur = s[0], j = 0;
                    while (j < n) {
                        if (s[j] != cur) { /* flush the finished segment */
                            for (int l = 0; l < LANES; l++) {
                                sum_g[h * S + cur] += acc_g[l];
                                sum_gx[h * S + cur] += acc_gx[l];
                                acc_g[l] = acc_gx[l] = 0.0f;
                            }
                            cur = s[j];
                        }
                        const float k = sl[cur];
                        if (left[j] >= LANES) {
                            for (int l = 0; l < LANES; l++) {
                                acc_g[l] += g[j + l];
                                acc_gx[l] += g[j + l] * x[j + l];
                                gx[j + l] += g[j + l] * k;
                            }
                            j += LANES;
                        } else {
                            acc_g[0] += g[j];
                            acc_gx[0] += g[j] * x[j];
                            gx[j] += g[j] * k;
                            j++;
                        }
                    }
                    for (int l = 0; l < LANES; l++) {
                        sum_g[h * S + cur] += acc_g[l];
                        sum_gx[h * S + cur] += acc_gx[l];
                    }
                }
                for (int64_t j = 0; j < n; j++) {
                    const int64_t d = distance(pi, krow[j0 + j]);
                    gpsi[d] += (double)gx[j] * r;
                    row += (double)gx[j] * psi[d];
                }
            }
            ginv[b * I + i] += row;
        }
    }
}
