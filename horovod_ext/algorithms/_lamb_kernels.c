/* LAMB's per-element step on the CPU, for float32 and float64, in two passes over a tensor
 * instead of about fifteen torch operations; hvd.Lamb (horovod_ext/algorithms/lamb.py) and SLAMB
 * (slamb/update.py, Algorithm 1, lines 10-19) share it:
 *   pass 1 (hx_lamb_moments_*): v = beta2 v + (1 - beta2) g^2; for SLAMB's staleness c (NULL for
 *     LAMB): c = beta3 c, then 1 at the selected elements (line 13); u = m^ / (sqrt(v^) + eps)
 *     + weight_decay x (lines 11-12); the sums of x^2 and u^2 over the tensor and over its
 *     selected elements (all of them when full);
 *   pass 2 (hx_lamb_update_*): the same u again, and x -= (a + (b + cc c) c) u: LAMB's
 *     lr * trust ratio (full: x -= a u), or the per-element coefficient eta~ phi~ that SLAMB
 *     derives from the four sums (lines 15-19).
 *
 * Plain C with no Python API, loaded through ctypes (horovod_ext/backends/native.py); the torch
 * code does the same where this library is not built.  Element-wise values use the same IEEE
 * operations as the torch code; the sums are float64 in eight fixed lanes added in a fixed
 * order (torch takes float32 norms), so every build gives the same bits.  target_clones picks
 * an AVX2 build where the CPU has one.  Build with -ffp-contract=off (a fused multiply-add
 * changes results between builds) and -fno-math-errno (else sqrt blocks vectorisation).
 */
#include <math.h>
#include <stdint.h>

#define KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))
/* Elements per block (a multiple of 8): a block's update directions stay in L1. */
#define BLK 1024

#define SUM8(LANES) \
    ((((LANES)[0] + (LANES)[1]) + ((LANES)[2] + (LANES)[3])) + \
     (((LANES)[4] + (LANES)[5]) + ((LANES)[6] + (LANES)[7])))

#define KERNELS(T, SFX, SQRT)                                                                 \
static inline T sqrt_##SFX(T x) { return SQRT(x); }                                           \
                                                                                              \
/* sums[0..3] += x.x, u.u, (x.x, u.u over the nidx sorted selected indices idx, all of them   \
 * when full); v, c updated in place. */                                                      \
KERNEL void hx_lamb_moments_##SFX(                                                           \
    const T *x, const T *g, const T *m, T *v, T *c, int64_t n, const int64_t *idx,            \
    int64_t nidx, int64_t full, double beta2_, double beta3_, double bc1_, double bc2_,       \
    double eps_, int64_t eps_inside, double wd_, double *sums)                                \
{                                                                                             \
    const T beta2 = (T)beta2_, one_minus_beta2 = (T)(1.0 - beta2_), beta3 = (T)beta3_;        \
    const T bc1 = (T)bc1_, bc2 = (T)bc2_, eps = (T)eps_, wd = (T)wd_;                         \
    T u[BLK] __attribute__((aligned(64)));                                                    \
    double xx[8] = {0}, uu[8] = {0}, xs = 0.0, us = 0.0;                                      \
    int64_t j = 0;                                                                            \
    for (int64_t lo = 0; lo < n; lo += BLK) {                                                 \
        const int64_t len = lo + BLK < n ? BLK : n - lo;                                      \
        const T *xb = x + lo, *gb = g + lo, *mb = m + lo;                                     \
        T *vb = v + lo, *cb = c ? c + lo : (T *)0;                                            \
        for (int64_t i = 0; i < len; i++) {                                                   \
            const T vn = vb[i] * beta2 + (one_minus_beta2 * gb[i]) * gb[i];                   \
            vb[i] = vn;                                                                       \
            u[i] = eps_inside ? (mb[i] / bc1) / sqrt_##SFX(vn / bc2 + eps) + wd * xb[i]       \
                              : (mb[i] / bc1) / (sqrt_##SFX(vn / bc2) + eps) + wd * xb[i];    \
            if (c) cb[i] = full ? (T)1 : cb[i] * beta3;                                       \
        }                                                                                     \
        int64_t i = 0;                                                                        \
        for (; i + 8 <= len; i += 8)                                                          \
            for (int k = 0; k < 8; k++) {                                                     \
                xx[k] += (double)xb[i + k] * (double)xb[i + k];                               \
                uu[k] += (double)u[i + k] * (double)u[i + k];                                 \
            }                                                                                 \
        for (int k = 0; i < len; i++, k++) {                                                  \
            xx[k] += (double)xb[i] * (double)xb[i];                                           \
            uu[k] += (double)u[i] * (double)u[i];                                             \
        }                                                                                     \
        for (; !full && j < nidx && idx[j] < lo + len; j++) {                                 \
            const int64_t k = idx[j] - lo;                                                    \
            cb[k] = (T)1;                                                                     \
            xs += (double)xb[k] * (double)xb[k];                                              \
            us += (double)u[k] * (double)u[k];                                                \
        }                                                                                     \
    }                                                                                         \
    const double x2 = SUM8(xx), u2 = SUM8(uu);                                                \
    sums[0] += x2;                                                                            \
    sums[1] += u2;                                                                            \
    sums[2] += full ? x2 : xs;                                                                \
    sums[3] += full ? u2 : us;                                                                \
}                                                                                             \
                                                                                              \
/* x -= (a + (b + cc c) c) u, u as in pass 1 (x not yet changed); with full, x -= a u. */     \
KERNEL void hx_lamb_update_##SFX(                                                            \
    T *x, const T *m, const T *v, const T *c, int64_t n, int64_t full, double bc1_,           \
    double bc2_, double eps_, int64_t eps_inside, double wd_, double a_, double b_,           \
    double cc_)                                                                               \
{                                                                                             \
    const T bc1 = (T)bc1_, bc2 = (T)bc2_, eps = (T)eps_, wd = (T)wd_;                         \
    const T a = (T)a_, b = (T)b_, cc = (T)cc_;                                                \
    for (int64_t i = 0; i < n; i++) {                                                         \
        const T u = eps_inside ? (m[i] / bc1) / sqrt_##SFX(v[i] / bc2 + eps) + wd * x[i]      \
                               : (m[i] / bc1) / (sqrt_##SFX(v[i] / bc2) + eps) + wd * x[i];   \
        const T coeff = full ? a : (b + cc * c[i]) * c[i] + a;                                \
        x[i] = x[i] - u * coeff;                                                              \
    }                                                                                         \
}

KERNELS(float, f32, sqrtf)
KERNELS(double, f64, sqrt)
