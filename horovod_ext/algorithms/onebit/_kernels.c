/* 1-bit compression's inner loops on the CPU, for float32 and float64: compensate + compress
 * (error update, input, sum of decompressed parts, per-segment sum of squares, sign packing) in
 * one pass, decompression, and the deferred error update.
 *
 * Plain C with no Python API, loaded through ctypes (horovod_ext/backends/native.py); the torch
 * code in torch_code.py does the same where this library is not built.  Bit i of byte k holds
 * element 8k + i and is set when the value's sign bit is clear (zero encodes as +1).  Every value
 * is computed with the same IEEE operations, in the same order, as the torch code, so the two
 * give the same bits; only the sums of squares differ: here float64 over eight fixed lanes
 * (every build gives the same bits), there float32 norms of rows combined in float64.
 *
 * Each exported function picks an AVX2 build (movemask packs 8 signs in one instruction) where
 * the CPU has it, at its first call.  Build with -ffp-contract=off: a fused multiply-add would
 * change the sums of squares between builds.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* Elements per block (a multiple of 8): the block's values and partial sums stay in L1/L2. */
#define BLK 2048

/* ±1 for each bit of each byte value, in both types: a byte of signs expands by one row load and
 * a multiplication by the scale (exact: the result is ±scale). */
static float TAB_f32[256][8] __attribute__((aligned(32)));
static double TAB_f64[256][8] __attribute__((aligned(64)));

__attribute__((constructor)) static void make_tables(void)
{
    for (int b = 0; b < 256; b++)
        for (int i = 0; i < 8; i++) {
            TAB_f32[b][i] = (b >> i) & 1 ? 1.0f : -1.0f;
            TAB_f64[b][i] = (b >> i) & 1 ? 1.0 : -1.0;
        }
}

static inline int sign_clear_f32(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return !(u >> 31);
}

static inline int sign_clear_f64(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return !(u >> 63);
}

static inline uint8_t pack8_generic_f32(const float *x)
{
    unsigned b = 0;
    for (int i = 0; i < 8; i++)
        b |= (unsigned)sign_clear_f32(x[i]) << i;
    return (uint8_t)b;
}

static inline uint8_t pack8_generic_f64(const double *x)
{
    unsigned b = 0;
    for (int i = 0; i < 8; i++)
        b |= (unsigned)sign_clear_f64(x[i]) << i;
    return (uint8_t)b;
}

#if HAVE_X86
__attribute__((target("avx2"))) static inline uint8_t pack8_avx2_f32(const float *x)
{
    return (uint8_t)~_mm256_movemask_ps(_mm256_loadu_ps(x));
}

__attribute__((target("avx2"))) static inline uint8_t pack8_avx2_f64(const double *x)
{
    const int lo = _mm256_movemask_pd(_mm256_loadu_pd(x));
    const int hi = _mm256_movemask_pd(_mm256_loadu_pd(x + 4));
    return (uint8_t)~(lo | (hi << 4));
}
#endif

/* Everything below is written once per (value type, build) by these macros.
 *   T: float or double; SFX: f32 or f64; ISA: generic or avx2; ATTR: the build's attribute. */
#define KERNELS(T, SFX, ISA, ATTR)                                                           \
                                                                                             \
/* dst[0 .. b-a) (element a .. b of the signs) = ±s, or += ±s when acc. */                   \
ATTR static inline void expand_##SFX##_##ISA(const uint8_t *signs, int64_t a, int64_t b,     \
                                              T s, T *dst, int acc)                          \
{                                                                                            \
    int64_t i = a;                                                                           \
    for (; i < b && (i & 7); i++) {                                                          \
        const T v = (signs[i >> 3] >> (i & 7)) & 1 ? s : -s;                                 \
        dst[i - a] = acc ? dst[i - a] + v : v;                                               \
    }                                                                                        \
    for (; i + 8 <= b; i += 8) {                                                             \
        const T *row = TAB_##SFX[signs[i >> 3]];                                             \
        T *d = dst + (i - a);                                                                \
        if (acc)                                                                             \
            for (int j = 0; j < 8; j++)                                                      \
                d[j] += row[j] * s;                                                          \
        else                                                                                 \
            for (int j = 0; j < 8; j++)                                                      \
                d[j] = row[j] * s;                                                           \
    }                                                                                        \
    for (; i < b; i++) {                                                                     \
        const T v = (signs[i >> 3] >> (i & 7)) & 1 ? s : -s;                                 \
        dst[i - a] = acc ? dst[i - a] + v : v;                                               \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Sum of squares of x[0 .. n) in float64, in eight fixed lanes added up in a fixed order. */ \
ATTR static inline double sumsq_##SFX##_##ISA(const T *x, int64_t n)                         \
{                                                                                            \
    double lane[8] = {0};                                                                    \
    int64_t i = 0;                                                                           \
    for (; i + 8 <= n; i += 8)                                                               \
        for (int j = 0; j < 8; j++)                                                          \
            lane[j] += (double)x[i + j] * (double)x[i + j];                                  \
    for (int j = 0; i < n; i++, j++)                                                         \
        lane[j] += (double)x[i] * (double)x[i];                                              \
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])); \
}                                                                                            \
                                                                                             \
/* The compensate-and-compress pass, see hx_onebit_compress_SFX below. */                    \
ATTR static void compress_##SFX##_##ISA(                                                     \
    const T *src, T *dst, int64_t n, const int64_t *lengths, int64_t nseg,                   \
    const T *pending, const T *dense, int64_t nparts, const uint8_t *const *signs,           \
    const T *part_scales, int normalise, uint8_t *out, double *sumsq)                        \
{                                                                                            \
    T buf[BLK] __attribute__((aligned(64)));                                                 \
    T tot[BLK] __attribute__((aligned(64)));                                                 \
    int64_t seg = 0, seg_lo = 0;                                                             \
    while (seg < nseg && lengths[seg] == 0)                                                  \
        seg++;                                                                               \
    for (int64_t lo = 0; lo < n; lo += BLK) {                                                \
        const int64_t hi = lo + BLK < n ? lo + BLK : n;                                      \
        int64_t a = lo;                                                                      \
        while (a < hi) {                                                                     \
            const int64_t seg_hi = seg_lo + lengths[seg];                                    \
            const int64_t b = seg_hi < hi ? seg_hi : hi;                                     \
            T *v = buf + (a - lo);                                                           \
            const int64_t m = b - a;                                                         \
            const T p = pending ? pending[seg] : (T)0;                                       \
            for (int64_t i = 0; i < m; i++) {                                                \
                T x = src[a + i];                                                            \
                if (normalise)                                                               \
                    x = x + (T)0;                                                            \
                if (pending)                                                                 \
                    x = x - (sign_clear_##SFX(x) ? p : -p);                                  \
                if (dense)                                                                   \
                    x = x + dense[a + i];                                                    \
                v[i] = x;                                                                    \
            }                                                                                \
            if (nparts) {                                                                    \
                for (int64_t j = 0; j < nparts; j++)                                         \
                    expand_##SFX##_##ISA(signs[j], a, b, part_scales[j * nseg + seg], tot, j > 0); \
                for (int64_t i = 0; i < m; i++)                                              \
                    v[i] = v[i] + tot[i];                                                    \
            }                                                                                \
            sumsq[seg] += sumsq_##SFX##_##ISA(v, m);                                         \
            if (dst)                                                                         \
                memcpy(dst + a, v, (size_t)m * sizeof(T));                                   \
            a = b;                                                                           \
            if (b == seg_hi) {                                                               \
                seg_lo = seg_hi;                                                             \
                seg++;                                                                       \
                while (seg < nseg && lengths[seg] == 0)                                      \
                    seg++;                                                                   \
            }                                                                                \
        }                                                                                    \
        const int64_t m = hi - lo, full = m & ~(int64_t)7;                                   \
        uint8_t *o = out + (lo >> 3);                                                        \
        for (int64_t i = 0; i < full; i += 8)                                                \
            o[i >> 3] = pack8_##ISA##_##SFX(buf + i);                                        \
        if (full < m) {                                                                      \
            unsigned last = 0xFF;                                                            \
            for (int64_t i = full; i < m; i++)                                               \
                if (!sign_clear_##SFX(buf[i]))                                               \
                    last &= ~(1u << (i - full));                                             \
            o[full >> 3] = (uint8_t)last;                                                    \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
ATTR static void decompress_##SFX##_##ISA(const uint8_t *signs, int64_t n,                   \
                                          const int64_t *lengths, int64_t nseg,              \
                                          const T *scales, T *out)                           \
{                                                                                            \
    int64_t a = 0;                                                                           \
    for (int64_t s = 0; s < nseg && a < n; s++) {                                            \
        const int64_t b = a + lengths[s] < n ? a + lengths[s] : n;                           \
        expand_##SFX##_##ISA(signs, a, b, scales[s], out + a, 0);                            \
        a = b;                                                                               \
    }                                                                                        \
}                                                                                            \
                                                                                             \
ATTR static void settle_##SFX##_##ISA(T *e, int64_t n, const int64_t *lengths, int64_t nseg, \
                                      const T *scales)                                       \
{                                                                                            \
    int64_t a = 0;                                                                           \
    for (int64_t s = 0; s < nseg && a < n; s++) {                                            \
        const int64_t b = a + lengths[s] < n ? a + lengths[s] : n;                           \
        const T p = scales[s];                                                               \
        for (int64_t i = a; i < b; i++)                                                      \
            e[i] = e[i] - (sign_clear_##SFX(e[i]) ? p : -p);                                 \
        a = b;                                                                               \
    }                                                                                        \
}

#define NOATTR
KERNELS(float, f32, generic, NOATTR)
KERNELS(double, f64, generic, NOATTR)
#if HAVE_X86
KERNELS(float, f32, avx2, __attribute__((target("avx2"))))
KERNELS(double, f64, avx2, __attribute__((target("avx2"))))
#endif

static int use_avx2(void)
{
#if HAVE_X86
    static int known = -1;
    if (known < 0)
        known = __builtin_cpu_supports("avx2") ? 1 : 0;
    return known;
#else
    return 0;
#endif
}

#if HAVE_X86
#define DISPATCH(NAME, SFX, ...)                                                             \
    do {                                                                                     \
        if (use_avx2())                                                                      \
            NAME##_##SFX##_avx2(__VA_ARGS__);                                                \
        else                                                                                 \
            NAME##_##SFX##_generic(__VA_ARGS__);                                             \
    } while (0)
#else
#define DISPATCH(NAME, SFX, ...) NAME##_##SFX##_generic(__VA_ARGS__)
#endif

/* One pass over the n elements of src, segment s (lengths[s] elements, zero lengths allowed)
 * taking, per element, in this order:
 *   x = src[i]; x += 0 if normalise (-0.0 -> +0.0); x -= copysign(pending[s], x) if pending;
 *   x += dense[i] if dense; x += t where t = sum over j < nparts, in order, of
 *   ±part_scales[j * nseg + s] by bit i of signs[j];
 * stores x in dst (may be src; NULL: not stored), adds x * x to sumsq[s] (float64) and packs the
 * signs of x into out (ceil(n / 8) bytes; unused bits of the last byte set). */
#define EXPORTS(T, SFX)                                                                      \
void hx_onebit_compress_##SFX(const T *src, T *dst, int64_t n, const int64_t *lengths,       \
                              int64_t nseg, const T *pending, const T *dense, int64_t nparts, \
                              const uint8_t *const *signs, const T *part_scales,             \
                              int64_t normalise, uint8_t *out, double *sumsq)                \
{                                                                                            \
    DISPATCH(compress, SFX, src, dst, n, lengths, nseg, pending, dense, nparts, signs,        \
             part_scales, (int)normalise, out, sumsq);                                       \
}                                                                                            \
/* out[i] = ±scales[s] by bit i of signs, for the n elements cut into segments of lengths. */ \
void hx_onebit_decompress_##SFX(const uint8_t *signs, int64_t n, const int64_t *lengths,     \
                                int64_t nseg, const T *scales, T *out)                       \
{                                                                                            \
    DISPATCH(decompress, SFX, signs, n, lengths, nseg, scales, out);                         \
}                                                                                            \
/* e[i] -= copysign(scales[s], e[i]): the deferred error update. */                          \
void hx_onebit_settle_##SFX(T *e, int64_t n, const int64_t *lengths, int64_t nseg,           \
                            const T *scales)                                                 \
{                                                                                            \
    DISPATCH(settle, SFX, e, n, lengths, nseg, scales);                                      \
}

EXPORTS(float, f32)
EXPORTS(double, f64)
