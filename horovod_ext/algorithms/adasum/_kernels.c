/* Adasum's inner loops on the CPU, for float32 and float64: per-layer [a.b, a.a, b.b] and the
 * per-layer weighted sum, each over a list of segments of two flat vectors.
 *
 * Plain C with no Python API, loaded through ctypes (horovod_ext/backends/native.py); the Python
 * code in operator.py does the same with torch ops when this library is not built.  One call
 * handles every segment of a piece, so a model with hundreds of small tensors costs one call,
 * and each loop reads its data once, where torch needs a float64 copy first.
 *
 * A segment is three int64: start (element of the vectors), length, layer (row of the tables).
 * Sums are float64 whatever the input type.  float32 dots multiply and add in float32 over
 * short blocks and carry each block's partial sums into float64: converting every element to
 * float64 first made the kernel conversion-bound (much slower), and the blocks keep the
 * relative error near 1e-9, far inside Adasum's 1e-5.  target_clones picks the AVX2+FMA build
 * where the CPU has it, at load time.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* x86-64-v3: AVX2 and FMA. */
#define KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))

typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) f64x4 load4_f64(const double *p)
{
    f64x4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sums run in eight fixed lanes (two vectors of four), added up in a fixed order at the end,
 * so every build (AVX2 or not) gives the same bits: ranks that compute the same Adasum on
 * different CPUs must agree exactly, or their parameters drift apart. */
#define DOTS(NAME, T, LOAD4)                                                           \
    KERNEL void NAME(const T *a, const T *b, const int64_t *segs, int64_t nseg,        \
                     double *dots)                                                     \
    {                                                                                  \
        for (int64_t s = 0; s < nseg; s++) {                                           \
            const T *x = a + segs[3 * s], *y = b + segs[3 * s];                        \
            const int64_t n = segs[3 * s + 1];                                         \
            f64x4 ab0 = {0}, aa0 = {0}, bb0 = {0}, ab1 = {0}, aa1 = {0}, bb1 = {0};    \
            int64_t i = 0;                                                             \
            for (; i + 8 <= n; i += 8) {                                               \
                const f64x4 u0 = LOAD4(x + i), v0 = LOAD4(y + i);                      \
                const f64x4 u1 = LOAD4(x + i + 4), v1 = LOAD4(y + i + 4);              \
                ab0 += u0 * v0;                                                        \
                aa0 += u0 * u0;                                                        \
                bb0 += v0 * v0;                                                        \
                ab1 += u1 * v1;                                                        \
                aa1 += u1 * u1;                                                        \
                bb1 += v1 * v1;                                                        \
            }                                                                          \
            double ab = 0.0, aa = 0.0, bb = 0.0;                                       \
            for (; i < n; i++) {                                                       \
                const double u = x[i], v = y[i];                                       \
                ab += u * v;                                                           \
                aa += u * u;                                                           \
                bb += v * v;                                                           \
            }                                                                          \
            ab0 += ab1;                                                                \
            aa0 += aa1;                                                                \
            bb0 += bb1;                                                                \
            for (int j = 0; j < 4; j++) {                                              \
                ab += ab0[j];                                                          \
                aa += aa0[j];                                                          \
                bb += bb0[j];                                                          \
            }                                                                          \
            double *row = dots + 3 * segs[3 * s + 2];                                  \
            row[0] += ab;                                                              \
            row[1] += aa;                                                              \
            row[2] += bb;                                                              \
        }                                                                              \
    }

/* Elements of a segment multiplied and summed in float32 before the sums move to float64:
 * each of the 16 float32 lanes adds 16 products per block. */
#define F32_BLOCK 256

static inline __attribute__((always_inline)) f32x8 load8_f32(const float *p)
{
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* acc += the eight lanes of s, widened to float64 (four lanes, in a fixed order). */
static inline __attribute__((always_inline)) void carry_f32(f32x8 s, f64x4 *acc)
{
    const f64x4 lo = __builtin_convertvector(__builtin_shufflevector(s, s, 0, 1, 2, 3), f64x4);
    const f64x4 hi = __builtin_convertvector(__builtin_shufflevector(s, s, 4, 5, 6, 7), f64x4);
    *acc += lo + hi;
}

/* [a.b, a.a, b.b] of one segment with every product and sum in float64 (exact products). */
static void dots_f32_exact(const float *x, const float *y, int64_t n, double *out)
{
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double u = x[i], v = y[i];
        ab += u * v;
        aa += u * u;
        bb += v * v;
    }
    out[0] = ab;
    out[1] = aa;
    out[2] = bb;
}

/* Below this mean square a float32 product may have been denormal (FLT_MIN * 2^24 = 2^-102),
 * losing digits that float64 keeps. */
#define F32_SAFE_MEAN_SQUARE 1.9721522630525295e-31

/* Compiled without FMA contraction (the file's -ffp-contract=off): a float32 product is rounded,
 * so fusing it would change the bits, and every build must give the same ones.  A segment whose
 * float32 products could have overflowed (|x| above ~1e19) or underflowed (values near 1e-19
 * and below) is summed again with float64 products, so the results are float64's over the
 * whole float32 range: the cheap path holds only where it is as good. */
KERNEL void hx_adasum_dots_f32(const float *a, const float *b, const int64_t *segs, int64_t nseg,
                               double *dots)
{
    for (int64_t s = 0; s < nseg; s++) {
        const float *x = a + segs[3 * s], *y = b + segs[3 * s];
        const int64_t n = segs[3 * s + 1];
        f64x4 ab_sum = {0}, aa_sum = {0}, bb_sum = {0};
        int64_t i = 0;
        for (; i + F32_BLOCK <= n; i += F32_BLOCK) {
            f32x8 ab0 = {0}, aa0 = {0}, bb0 = {0}, ab1 = {0}, aa1 = {0}, bb1 = {0};
            for (int64_t j = i; j < i + F32_BLOCK; j += 16) {
                const f32x8 u0 = load8_f32(x + j), v0 = load8_f32(y + j);
                const f32x8 u1 = load8_f32(x + j + 8), v1 = load8_f32(y + j + 8);
                ab0 += u0 * v0;
                aa0 += u0 * u0;
                bb0 += v0 * v0;
                ab1 += u1 * v1;
                aa1 += u1 * u1;
                bb1 += v1 * v1;
            }
            carry_f32(ab0 + ab1, &ab_sum);
            carry_f32(aa0 + aa1, &aa_sum);
            carry_f32(bb0 + bb1, &bb_sum);
        }
        double ab = 0.0, aa = 0.0, bb = 0.0;
        for (; i < n; i++) {
            const double u = x[i], v = y[i];
            ab += u * v;
            aa += u * u;
            bb += v * v;
        }
        for (int j = 0; j < 4; j++) {
            ab += ab_sum[j];
            aa += aa_sum[j];
            bb += bb_sum[j];
        }
        const double floor = F32_SAFE_MEAN_SQUARE * (double)n;
        if (n >= F32_BLOCK && !(aa + bb + (ab < 0 ? -ab : ab) < 1e300 && aa >= floor && bb >= floor)) {
            double exact[3];   /* the negated test also catches inf and NaN */
            dots_f32_exact(x, y, n, exact);
            ab = exact[0];
            aa = exact[1];
            bb = exact[2];
        }
        double *row = dots + 3 * segs[3 * s + 2];
        row[0] += ab;
        row[1] += aa;
        row[2] += bb;
    }
}

/* The weights of a and b per layer from its [a.b, a.a, b.b]: 1 - a.b / (div_a |a|^2) and
 * 1 - a.b / (div_b |b|^2); a zero side weighs 1, so the other side passes through unchanged.
 * div_a = (W_a + W_b) / W_a for sides that stand for W_a and W_b ranks (rvh.py's fold makes them
 * unequal at counts that are not powers of two); equal sides give exactly 2.0, so the usual
 * 1 - a.b / (2 |a|^2) comes out of the very same operations, bit for bit.
 * Written as (weight of out, weight of other) for a combine whose out is b when out_is_b.
 * (Named apart from the unweighted hx_adasum_weights it replaces: a stale build lacks this
 * symbol and is refused by native.load instead of being called with arguments it ignores.) */
void hx_adasum_coefficients(const double *dots, int64_t layers, int64_t out_is_b, double div_a,
                            double div_b, double *weights)
{
    const int64_t wa = out_is_b ? 1 : 0;
    for (int64_t l = 0; l < layers; l++) {
        const double ab = dots[3 * l], aa = dots[3 * l + 1], bb = dots[3 * l + 2];
        weights[2 * l + wa] = aa > 0.0 ? 1.0 - ab / (div_a * aa) : 1.0;
        weights[2 * l + 1 - wa] = bb > 0.0 ? 1.0 - ab / (div_b * bb) : 1.0;
    }
}

/* out = w_out * out + w_other * other, with (w_out, w_other) = weights[2 * layer ...].  Two
 * rounded products and one rounded sum: the same bits whichever of a and b is out, so two
 * ranks that compute the same pair with out = a on one and out = b on the other agree. */
#define COMBINE(NAME, T)                                                               \
    KERNEL void NAME(T *out, const T *other, const int64_t *segs, int64_t nseg,        \
                     const double *weights)                                            \
    {                                                                                  \
        for (int64_t s = 0; s < nseg; s++) {                                           \
            T *x = out + segs[3 * s];                                                  \
            const T *y = other + segs[3 * s];                                          \
            const int64_t n = segs[3 * s + 1];                                         \
            const T wx = (T)weights[2 * segs[3 * s + 2]];                              \
            const T wy = (T)weights[2 * segs[3 * s + 2] + 1];                          \
            for (int64_t i = 0; i < n; i++)                                            \
                x[i] = wx * x[i] + wy * y[i];                                          \
        }                                                                              \
    }

DOTS(hx_adasum_dots_f64, double, load4_f64)
COMBINE(hx_adasum_combine_f32, float)
COMBINE(hx_adasum_combine_f64, double)

/* ---- The in-node tree from one Gram matrix (gram.py) ------------------------------------------
 * v: k >= 3 vectors (pointers; two take hx_adasum_dots_*); segments as above.  gram gets, per
 * layer, the packed upper triangle of the k x k matrix of dot products, row by row: (0,0),
 * (0,1), ..., (0,k-1), (1,1), ...  The elements go by blocks of F32_BLOCK, every pair of a block
 * while it is in L1.  Products are float64 (float32 elements widened first): the tree's
 * coefficients past its first level come from sums and differences of the products, and a node
 * whose inputs nearly cancel needs them to float64's precision (float32 products summed in
 * blocks, 1e-9 of |x|^2 off, made such a node 100 times less accurate than the tree computed
 * level by level). */
#define GRAM_PAIRS(k) ((k) * ((k) + 1) / 2)

static inline __attribute__((always_inline)) void widen8(const float *p, f64x4 *lo, f64x4 *hi)
{
    const f32x8 u = load8_f32(p);
    *lo = __builtin_convertvector(__builtin_shufflevector(u, u, 0, 1, 2, 3), f64x4);
    *hi = __builtin_convertvector(__builtin_shufflevector(u, u, 4, 5, 6, 7), f64x4);
}

/* One block into acc (one f64x4 per pair); for a few vectors (K known when compiled) each 4
 * elements of every vector are widened once for all pairs, and the block's sums stay in
 * registers (K = 4: 10 sums and 4 widened vectors, within AVX2's 16) before they join acc,
 * which lives in memory (its length is k's); any k widens them per pair. */
typedef float f32x4 __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) f64x4 widen4(const float *p)
{
    f32x4 u;
    memcpy(&u, p, sizeof u);
    return __builtin_convertvector(u, f64x4);
}

#define GRAM_BLOCK(NAME, K)                                                            \
    static inline __attribute__((always_inline)) void NAME(const float *const *v,      \
                                                           int64_t at, f64x4 *acc)     \
    {                                                                                  \
        f64x4 sum[GRAM_PAIRS(K)] = {0};                                                \
        for (int64_t j = at; j < at + F32_BLOCK; j += 4) {                             \
            f64x4 x[K];                                                                \
            for (int a = 0; a < K; a++)                                                \
                x[a] = widen4(v[a] + j);                                               \
            for (int a = 0, p = 0; a < K; a++)                                         \
                for (int b = a; b < K; b++, p++)                                       \
                    sum[p] += x[a] * x[b];                                             \
        }                                                                              \
        for (int p = 0; p < GRAM_PAIRS(K); p++)                                        \
            acc[p] += sum[p];                                                          \
    }

GRAM_BLOCK(gram_block_3, 3)
GRAM_BLOCK(gram_block_4, 4)

static inline __attribute__((always_inline)) void gram_block_k(const float *const *v,
                                                               int64_t k, int64_t at,
                                                               f64x4 *acc)
{
    for (int64_t a = 0, p = 0; a < k; a++)
        for (int64_t b = a; b < k; b++, p++)
            for (int64_t j = at; j < at + F32_BLOCK; j += 8) {
                f64x4 xl, xh, yl, yh;
                widen8(v[a] + j, &xl, &xh);
                widen8(v[b] + j, &yl, &yh);
                acc[p] += xl * yl + xh * yh;
            }
}

static inline __attribute__((always_inline)) void gram_block_f64(const double *const *v,
                                                                 int64_t k, int64_t at,
                                                                 f64x4 *acc)
{
    for (int64_t a = 0, p = 0; a < k; a++)
        for (int64_t b = a; b < k; b++, p++)
            for (int64_t j = at; j < at + F32_BLOCK; j += 4)
                acc[p] += load4_f64(v[a] + j) * load4_f64(v[b] + j);
}

/* The blocks through BLOCK, then the tail element by element, then each pair's lanes, added
 * into the layer's row. */
#define GRAM(NAME, T, BLOCK)                                                           \
    KERNEL void NAME(const T *const *v, int64_t k, const int64_t *segs, int64_t nseg,  \
                     double *gram)                                                     \
    {                                                                                  \
        const int64_t pairs = GRAM_PAIRS(k);                                           \
        f64x4 acc[pairs];                                                              \
        for (int64_t s = 0; s < nseg; s++) {                                           \
            const int64_t start = segs[3 * s], n = segs[3 * s + 1];                    \
            const T *at[k];                                                            \
            for (int64_t a = 0; a < k; a++)                                            \
                at[a] = v[a] + start;                                                  \
            for (int64_t p = 0; p < pairs; p++)                                        \
                acc[p] = (f64x4){0};                                                   \
            int64_t i = 0;                                                             \
            for (; i + F32_BLOCK <= n; i += F32_BLOCK)                                 \
                BLOCK;                                                                 \
            double *row = gram + pairs * segs[3 * s + 2];                              \
            for (int64_t a = 0, p = 0; a < k; a++)                                     \
                for (int64_t b = a; b < k; b++, p++) {                                 \
                    double sum = 0.0;                                                  \
                    for (int64_t t = i; t < n; t++)                                    \
                        sum += (double)at[a][t] * (double)at[b][t];                    \
                    for (int j = 0; j < 4; j++)                                        \
                        sum += acc[p][j];                                              \
                    row[p] += sum;                                                     \
                }                                                                      \
        }                                                                              \
    }

GRAM(hx_adasum_gram_f32, float,
     k == 3 ? gram_block_3(at, i, acc) : k == 4 ? gram_block_4(at, i, acc)
            : gram_block_k(at, k, i, acc))
GRAM(hx_adasum_gram_f64, double, gram_block_f64(at, k, i, acc))

/* out = sum over j of (T)weights[layer * k + j] * v[j], added in the order j = 0, 1, ...; copy
 * (may be NULL) gets the same.  out and copy may each be one of the v (at the same offsets,
 * never a partial overlap): each element is read before it is written, so ivdep lets the
 * loops vectorise without the overlap check that would run them scalar.  For a few vectors
 * (K known when compiled) one loop reads them all; any k goes block by block through a small
 * sum.  Two vectors give the bits of hx_adasum_combine_*: w0 * v0 + w1 * v1. */
#define MIX_K(NAME, T, K)                                                              \
    static inline __attribute__((always_inline)) void NAME(const T *const *v, T *out,  \
                                                           T *copy, int64_t start,     \
                                                           int64_t n, const T *w)      \
    {                                                                                  \
        T *const also = copy ? copy : out;   /* without a copy: out, twice (no branch) */ \
        _Pragma("GCC ivdep")                                                           \
        for (int64_t i = start; i < start + n; i++) {                                  \
            T sum = w[0] * v[0][i];                                                    \
            for (int j = 1; j < K; j++)                                                \
                sum = sum + w[j] * v[j][i];                                            \
            out[i] = sum;                                                              \
            also[i] = sum;                                                             \
        }                                                                              \
    }

#define MIX(NAME, T)                                                                   \
    MIX_K(NAME##_2, T, 2)                                                              \
    MIX_K(NAME##_3, T, 3)                                                              \
    MIX_K(NAME##_4, T, 4)                                                              \
    KERNEL void NAME(const T *const *v, int64_t k, T *out, T *copy, const int64_t *segs, \
                     int64_t nseg, const double *weights)                              \
    {                                                                                  \
        T w[k], sum[F32_BLOCK];                                                        \
        for (int64_t s = 0; s < nseg; s++) {                                           \
            const int64_t start = segs[3 * s], n = segs[3 * s + 1];                    \
            for (int64_t j = 0; j < k; j++)                                            \
                w[j] = (T)weights[k * segs[3 * s + 2] + j];                            \
            if (k == 2) {                                                              \
                NAME##_2(v, out, copy, start, n, w);                                   \
                continue;                                                              \
            }                                                                          \
            if (k == 3) {                                                              \
                NAME##_3(v, out, copy, start, n, w);                                   \
                continue;                                                              \
            }                                                                          \
            if (k == 4) {                                                              \
                NAME##_4(v, out, copy, start, n, w);                                   \
                continue;                                                              \
            }                                                                          \
            for (int64_t i = start; i < start + n; i += F32_BLOCK) {                   \
                const int64_t m = n - (i - start) < F32_BLOCK ? n - (i - start) : F32_BLOCK; \
                for (int64_t t = 0; t < m; t++)                                        \
                    sum[t] = w[0] * v[0][i + t];                                       \
                for (int64_t j = 1; j < k; j++)                                        \
                    for (int64_t t = 0; t < m; t++)                                    \
                        sum[t] = sum[t] + w[j] * v[j][i + t];                          \
                memcpy(out + i, sum, m * sizeof(T));                                   \
                if (copy)                                                              \
                    memcpy(copy + i, sum, m * sizeof(T));                              \
            }                                                                          \
        }                                                                              \
    }

MIX(hx_adasum_mix_f32, float)
MIX(hx_adasum_mix_f64, double)

/* Per layer, the weight of each of k inputs in the root of the tree, from the packed Gram
 * matrices (layers, k (k + 1) / 2); pairs: npairs (a, b) in the tree's order, divisors:
 * (d_a, d_b) per pair; weights: (layers, k).  gram.py's tree_weights, which says why. */
void hx_adasum_tree_weights(const double *packed, int64_t layers, int64_t k,
                            const int64_t *pairs, const double *divisors, int64_t npairs,
                            double zero_side, double *weights)
{
    double g[k][k], w[k][k], scale[k], ga[k], gb[k];
    for (int64_t l = 0; l < layers; l++) {
        const double *row = packed + l * GRAM_PAIRS(k);
        for (int64_t a = 0, p = 0; a < k; a++)
            for (int64_t b = a; b < k; b++, p++)
                g[a][b] = g[b][a] = row[p];
        for (int64_t a = 0; a < k; a++) {
            scale[a] = g[a][a] > 0.0 ? sqrt(g[a][a]) : 0.0;
            for (int64_t b = 0; b < k; b++)
                w[a][b] = a == b ? 1.0 : 0.0;
        }
        for (int64_t q = 0; q < npairs; q++) {
            const double *wa = w[pairs[2 * q]], *wb = w[pairs[2 * q + 1]];
            double ab = 0.0, aa = 0.0, bb = 0.0, sa = 0.0, sb = 0.0;
            for (int64_t i = 0; i < k; i++) {
                ga[i] = gb[i] = 0.0;
                for (int64_t j = 0; j < k; j++) {
                    ga[i] += g[i][j] * wa[j];
                    gb[i] += g[i][j] * wb[j];
                }
            }
            for (int64_t i = 0; i < k; i++) {
                ab += wa[i] * gb[i];
                aa += wa[i] * ga[i];
                bb += wb[i] * gb[i];
                sa += fabs(wa[i]) * scale[i];
                sb += fabs(wb[i]) * scale[i];
            }
            const int a_zero = aa <= zero_side * sa * sa, b_zero = bb <= zero_side * sb * sb;
            if (a_zero || b_zero)
                ab = 0.0;
            const double ca = a_zero ? 1.0 : 1.0 - ab / (divisors[2 * q] * aa);
            const double cb = b_zero ? 1.0 : 1.0 - ab / (divisors[2 * q + 1] * bb);
            double *out = w[pairs[2 * q]];
            for (int64_t i = 0; i < k; i++)
                out[i] = ca * wa[i] + cb * wb[i];
        }
        for (int64_t i = 0; i < k; i++)
            weights[l * k + i] = w[0][i];
    }
}
