/* The compiled Box–Muller of flwr_corrnoise.cipher_noise (transform 2): the same IEEE-754
 * steps as that module's NumPy path, in one fused loop that GCC vectorizes.
 *
 * Why it is bit-identical to the NumPy path: every step is one NumPy also performs one
 * element at a time with IEEE-754 round-to-nearest — integer shifts and masks, int32 -> float
 * conversion, +, -, *, /, sqrt, a comparison, a table read — in the same order, and the
 * build passes -ffp-contract=off, so no a*b+c is fused into an FMA (one rounding instead of
 * two). There is no libm call (libm's last bits differ between builds and SIMD levels).
 * The constants and the direction tables come from Python (cn_init), so there is one copy
 * of each. The module's docstring defines the transform; built and loaded by
 * flwr_corrnoise/compiled_kernel.py, checked against a scalar reference bit for bit by
 * tests/noise/test_cipher_noise.py and against the NumPy path by test_compiled_kernel.py.
 *
 * A chunk of m pairs is m 64-bit radius words, then m angle words (32 bits for float32, 64
 * for float64). A radius word below 2^32 takes the rare refill path, which is not here: the
 * functions return 1 when a chunk has one, and the caller recomputes that chunk in NumPy. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SECTORS 2048

static float COS32[SECTORS], SIN32[SECTORS];
static double COS64[SECTORS], SIN64[SECTORS];
/* float32 constants, in the order of cipher_noise._K32 */
static float K32[11];
/* float64 constants, in the order of cipher_noise._K64 */
static double K64[17];
/* the float64 ln's table: 1/c_i, then ln c_i and ln(c_i/2), c_i = 1 + i/128 */
static double INV64[128], LOGC64[256];

enum { F_HI, F_LO, F_HALF, F_LN2, F_PHI, F_SIN3, F_A9, F_A7, F_A5, F_A3, F_A1 };
enum { D_HI, D_LO, D_HALF, D_LN2, D_EXP, D_PHI, D_S5, D_S3, D_C4, D_L8 }; /* D_L8 .. D_L1 */

void cn_init(const double *cos64, const double *sin64, const float *cos32,
             const float *sin32, const float *k32, const double *k64, const double *inv64,
             const double *logc64) {
    memcpy(INV64, inv64, sizeof INV64);
    memcpy(LOGC64, logc64, sizeof LOGC64);
    memcpy(COS64, cos64, sizeof COS64);
    memcpy(SIN64, sin64, sizeof SIN64);
    memcpy(COS32, cos32, sizeof COS32);
    memcpy(SIN32, sin32, sizeof SIN32);
    memcpy(K32, k32, sizeof K32);
    memcpy(K64, k64, sizeof K64);
}

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint64_t d2u(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }
static inline double u2d(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }

static inline float radius32(uint64_t w, const float *restrict K) {
    float u = (float)(int32_t)(w >> 33) * K[F_HI]
              + ((float)(int32_t)((w >> 2) & 0x7FFFFFFF) * K[F_LO] + K[F_HALF]);
    uint32_t b = f2u(u);
    uint32_t mb = (b & 0x7FFFFF) | 0x3F800000;
    uint32_t big = mb > 0x3FB504F3; /* the mantissa above fl32(sqrt 2): halve it */
    float e = (float)(int32_t)((b >> 23) + big) - 127.0f;
    float x = u2f(mb - (big << 23));
    float s = (x - 1.0f) / (x + 1.0f);
    float z = s * s;
    float p = (((K[F_A9] * z + K[F_A7]) * z + K[F_A5]) * z + K[F_A3]) * z + K[F_A1];
    float lnu = e * K[F_LN2] + p * s;
    return __builtin_sqrtf(lnu * -2.0f + 0.0f); /* + 0: u = 1 gives +0, not -0 */
}

static inline void angle32(float R, uint32_t a, float *z1, float *z2, const float *restrict K,
                           const float *restrict cos, const float *restrict sin) {
    uint32_t k = a >> 21;
    float f = (float)(int32_t)(a & 0x1FFFFF) * K[F_PHI];
    float t = f * f;
    float sn = (t * K[F_SIN3]) * f + f;
    float cm = t * -0.5f;
    float rc = cos[k] * R, rs = sin[k] * R;
    *z1 = rc + (rc * cm - rs * sn);
    *z2 = rs + (rs * cm + rc * sn);
}

/* float64: a table, not the atanh series (its 11 terms and a division cost 2.7 ns a normal,
 * this 1.5): u = 2^e·x, x in [1, 2), i its top 7 mantissa bits, c = 1 + i/128 (exact),
 * r = (x - c)·fl(1/c) (|r| < 2^-7), ln(1 + r) to r^8, ln u = (e·ln 2 + ln c) + that; for u in
 * [1/2, 1) the table holds ln(c/2) itself (no e·ln 2 to cancel against it near u = 1). */
static inline double radius64(uint64_t w, const double *restrict K,
                              const double *restrict inv, const double *restrict logc) {
    double u = (double)(int32_t)(w >> 33) * K[D_HI]
               + ((double)(int32_t)((w >> 2) & 0x7FFFFFFF) * K[D_LO] + K[D_HALF]);
    uint64_t b = d2u(u);
    uint64_t eb = b >> 52;
    uint64_t top = eb == 1022; /* u in [1/2, 1) */
    double e = u2d((eb + top) | 0x4330000000000000ULL) - K[D_EXP];
    uint64_t i = (b >> 45) & 127;
    double x = u2d((b & 0xFFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL);
    double c = u2d(0x3FF0000000000000ULL | (i << 45));
    double r = (x - c) * inv[i];
    double p = K[D_L8];
    for (int j = 1; j < 8; j++) p = p * r + K[D_L8 + j];
    double lnu = (e * K[D_LN2] + logc[i | (top << 7)]) + p * r;
    double L = lnu * -2.0 + 0.0; /* + 0: u = 1 gives +0, not -0 */
    return __builtin_sqrt(L > 0.0 ? L : 0.0);
}

static inline void angle64(double R, uint64_t a, double *z1, double *z2,
                           const double *restrict K, const double *restrict cos,
                           const double *restrict sin) {
    uint64_t k = a >> 53;
    double f = (u2d((a & 0xFFFFFFFFFFFFFULL) | 0x4330000000000000ULL) - 0x1p52) * K[D_PHI];
    double t = f * f;
    double sn = ((t * K[D_S5] - K[D_S3]) * t) * f + f;
    double cm = (t * K[D_C4] - 0.5) * t;
    double rc = cos[k] * R, rs = sin[k] * R;
    *z1 = rc + (rc * cm - rs * sn);
    *z2 = rs + (rs * cm + rc * sn);
}

/* One chunk's pairs (row64 below is the same loop in float64: C has no generics, and a
 * macro would hide the loop the compiler must vectorize). Not inlined: its restrict
 * arguments are what lets the loop vectorize. */
__attribute__((noinline)) static uint64_t
row32(const uint64_t *restrict rw, const uint32_t *restrict aw, size_t m, float *restrict c,
      float *restrict s, size_t ns, unsigned below, const float *restrict K,
      const float *restrict cos, const float *restrict sin) {
    uint64_t low = 0;
    for (size_t i = 0; i < ns; i++) {
        uint64_t w = rw[i];
        low |= (w >> below) == 0;
        angle32(radius32(w, K), aw[i], c + i, s + i, K, cos, sin);
    }
    for (size_t i = ns; i < m; i++) {
        float unused;
        low |= (rw[i] >> below) == 0;
        angle32(radius32(rw[i], K), aw[i], c + i, &unused, K, cos, sin);
    }
    return low;
}

__attribute__((noinline)) static uint64_t
row64(const uint64_t *restrict rw, const uint64_t *restrict aw, size_t m, double *restrict c,
      double *restrict s, size_t ns, unsigned below, const double *restrict K,
      const double *restrict cos, const double *restrict sin, const double *restrict inv,
      const double *restrict logc) {
    uint64_t low = 0;
    for (size_t i = 0; i < ns; i++) {
        uint64_t w = rw[i];
        low |= (w >> below) == 0;
        angle64(radius64(w, K, inv, logc), aw[i], c + i, s + i, K, cos, sin);
    }
    for (size_t i = ns; i < m; i++) {
        double unused;
        low |= (rw[i] >> below) == 0;
        angle64(radius64(rw[i], K, inv, logc), aw[i], c + i, &unused, K, cos, sin);
    }
    return low;
}

/* m pairs of one chunk or piece in either dtype (the one dispatch of cn_rows and cn_row):
 * radius words rw, angle words aw, cosines at oc, sines at os (ns of them). The tables and
 * constants go in as restrict arguments: no store into the row changes them, so the
 * compiler keeps them in registers and the loops vectorize. */
static uint64_t chunk_pairs(int f32, const uint64_t *rw, const uint8_t *aw, size_t m,
                            void *oc, void *os, size_t ns, unsigned below) {
    if (f32)
        return row32(rw, (const uint32_t *)aw, m, oc, os, ns, below, K32, COS32, SIN32);
    return row64(rw, (const uint64_t *)aw, m, oc, os, ns, below, K64, COS64, SIN64, INV64,
                 LOGC64);
}

/* `rows` chunks of m pairs: chunk i's keystream at ks + i*ks_stride (bytes), its cosines at
 * oc + i*out_stride, its sines at os + i*out_stride (elements, float32 if f32 else float64):
 * ns of them (m or m - 1, an odd row drops its last sine). Returns 1 if a radius word is
 * below 2^below (2^32; nothing else should be trusted then: the caller recomputes), else 0. */
int cn_rows(const uint8_t *ks, size_t ks_stride, size_t rows, size_t m, void *oc, void *os,
            size_t out_stride, size_t ns, unsigned below, int f32) {
    size_t step = out_stride * (f32 ? sizeof(float) : sizeof(double)); /* bytes a row */
    uint64_t low = 0;
    for (size_t row = 0; row < rows; row++)
        low |= chunk_pairs(f32, (const uint64_t *)(ks + row * ks_stride),
                           ks + row * ks_stride + 8 * m, m, (char *)oc + row * step,
                           (char *)os + row * step, ns, below);
    return low != 0;
}

/* `tau` steps of a BLT stream's recurrence (Dvijotham et al., "Efficient and Near-Optimal
 * Noise Generation for Streaming Differential Privacy") in one pass over its k buffers: step
 * t takes e = rows[t] (its draw, replaced by its increment), e -= sum_i omega_i r_i, then
 * r_i = theta_i r_i + e. The order is the NumPy path's (streaming.NumpyOps.blt_step), every
 * product and sum rounded on its own (no FMA: -ffp-contract=off), so both give the same
 * floats on every machine. In blocks of BLT_BLOCK columns, all tau steps of a block while
 * it is in cache, so a learner's round crosses the buffers once, not once a step. For
 * k <= 5 buffers (the library's BLTs have 4 by default) a column's k values stay in
 * registers through its step, each loaded once and stored once, the loop over columns
 * vectorized with k unrolled: 1.4-2x the former version, which summed into a scratch row
 * and updated out in place after copying r into it (docs/benchmarks.md, "Issue 34, tenth
 * pass"); more buffers take that row-by-row way (GCC 12 does not vectorize the register
 * loop from k = 6 on: 3x slower there). r and out: k rows,
 * r_stride and out_stride elements apart; rows: tau rows, rows_stride apart. One step
 * (tau = 1) is the single-step case, the same floats. */
#define BLT_BLOCK 128
#define BLT_MAX_REG 5
#define BLT_STEPS(NAME, T)                                                                  \
    static inline __attribute__((always_inline)) void NAME##_reg(                          \
        const T *restrict src, size_t ss, T *restrict dst, size_t ds, T *restrict el,      \
        const T *restrict theta, const T *restrict omega, const size_t K, size_t n) {      \
        T w[BLT_MAX_REG], th[BLT_MAX_REG];                                                 \
        for (size_t i = 0; i < K; i++) { w[i] = omega[i]; th[i] = theta[i]; }              \
        for (size_t j = 0; j < n; j++) {                                                   \
            T v[BLT_MAX_REG];                                                              \
            for (size_t i = 0; i < K; i++) v[i] = src[i * ss + j];                         \
            T s = w[0] * v[0];                                                             \
            for (size_t i = 1; i < K; i++) s = s + w[i] * v[i];                            \
            T e = el[j] - s;                                                               \
            el[j] = e;                                                                     \
            for (size_t i = 0; i < K; i++) dst[i * ds + j] = th[i] * v[i] + e;             \
        }                                                                                  \
    }                                                                                      \
    /* a block's tau steps, k <= BLT_MAX_REG: step 0 reads r, the last writes out, the  */ \
    /* ones between go back and forth between two scratch blocks in L1, so no step     */  \
    /* reads the memory it writes (the restrict pointers above are never aliased)      */  \
    static inline __attribute__((always_inline)) void NAME##_block(                        \
        const T *r, size_t r_stride, T *out, size_t out_stride, T *rows,                   \
        size_t rows_stride, const T *theta, const T *omega, const size_t K, size_t n,      \
        size_t tau) {                                                                      \
        T scratch[2][BLT_MAX_REG * BLT_BLOCK];                                             \
        const T *src = r;                                                                  \
        size_t ss = r_stride;                                                              \
        for (size_t t = 0; t < tau; t++) {                                                 \
            int last = t + 1 == tau;                                                       \
            T *dst = last ? out : scratch[t & 1];                                          \
            size_t ds = last ? out_stride : BLT_BLOCK;                                     \
            NAME##_reg(src, ss, dst, ds, rows + t * rows_stride, theta, omega, K, n);      \
            src = dst;                                                                     \
            ss = ds;                                                                       \
        }                                                                                  \
    }                                                                                      \
    void NAME(const T *restrict r, size_t r_stride, T *restrict out, size_t out_stride,    \
              T *restrict rows, size_t rows_stride, const T *restrict theta,               \
              const T *restrict omega, size_t k, size_t d, size_t tau) {                   \
        T s[BLT_BLOCK];                                                                    \
        for (size_t lo = 0; lo < d && k && tau; lo += BLT_BLOCK) {                         \
            size_t n = d - lo < BLT_BLOCK ? d - lo : BLT_BLOCK;                            \
            const T *rb = r + lo;                                                          \
            T *ob = out + lo, *eb = rows + lo;                                             \
            switch (k) {                                                                   \
            case 1: NAME##_block(rb, r_stride, ob, out_stride, eb, rows_stride, theta,     \
                                 omega, 1, n, tau); continue;                              \
            case 2: NAME##_block(rb, r_stride, ob, out_stride, eb, rows_stride, theta,     \
                                 omega, 2, n, tau); continue;                              \
            case 3: NAME##_block(rb, r_stride, ob, out_stride, eb, rows_stride, theta,     \
                                 omega, 3, n, tau); continue;                              \
            case 4: NAME##_block(rb, r_stride, ob, out_stride, eb, rows_stride, theta,     \
                                 omega, 4, n, tau); continue;                              \
            case 5: NAME##_block(rb, r_stride, ob, out_stride, eb, rows_stride, theta,     \
                                 omega, 5, n, tau); continue;                              \
            default: break;                                                                \
            }                                                                              \
            /* more buffers: r copied into out, then each step in place, row by row */     \
            for (size_t i = 0; i < k; i++)                                                 \
                memcpy(out + i * out_stride + lo, r + i * r_stride + lo, n * sizeof(T));   \
            for (size_t t = 0; t < tau; t++) {                                             \
                const T *o0 = out + lo;                                                    \
                T w0 = omega[0];                                                           \
                for (size_t j = 0; j < n; j++) s[j] = w0 * o0[j];                          \
                for (size_t i = 1; i < k; i++) {                                           \
                    const T *oi = out + i * out_stride + lo;                               \
                    T wi = omega[i];                                                       \
                    for (size_t j = 0; j < n; j++) s[j] = s[j] + wi * oi[j];               \
                }                                                                          \
                T *el = rows + t * rows_stride + lo;                                       \
                for (size_t j = 0; j < n; j++) el[j] = el[j] - s[j];                       \
                for (size_t i = 0; i < k; i++) {                                           \
                    T *oi = out + i * out_stride + lo;                                     \
                    T ti = theta[i];                                                       \
                    for (size_t j = 0; j < n; j++) oi[j] = ti * oi[j] + el[j];             \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }
BLT_STEPS(cn_blt_steps32, float)
BLT_STEPS(cn_blt_steps64, double)

/* Each of `rows` rows' sum of squares in double (row i at g + i*stride, n elements), in
 * the one order learner.row_sums_of_squares defines, so that its NumPy path gives the same
 * doubles: 64 lanes, lane l the running sum of the squares of elements l, l+64, l+128, ...
 * of the row (as if it were padded with zeros to a multiple of 64: a lane past the row's
 * end adds nothing); then the 64 lanes added left to right. A float's square is exact in
 * double; a double's is rounded once (IEEE, no FMA: -ffp-contract=off). Why: NumPy's einsum
 * first converted a float32 row to float64 (a new array: at d = 10^5 the norm took 60-78
 * us, this 16; docs/benchmarks.md, "Issue 34, tenth pass"); the lanes vectorize, and 64 of
 * them keep NumPy's own reduction down them near its einsum's speed. */
#define SUMSQ_LANES 64
#define SUMSQ(NAME, T)                                                                      \
    void NAME(const T *restrict g, size_t rows, size_t stride, size_t n,                   \
              double *restrict out) {                                                      \
        size_t m = n / SUMSQ_LANES * SUMSQ_LANES;                                          \
        for (size_t r = 0; r < rows; r++) {                                                \
            const T *x = g + r * stride;                                                   \
            if (n <= SUMSQ_LANES) { /* each lane one square or none: left to right */      \
                double total = 0;                                                          \
                for (size_t i = 0; i < n; i++) {                                           \
                    double v = (double)x[i];                                               \
                    total = total + v * v;                                                 \
                }                                                                          \
                out[r] = total;                                                            \
                continue;                                                                  \
            }                                                                              \
            double acc[SUMSQ_LANES] = {0};                                                 \
            for (size_t i = 0; i < m; i += SUMSQ_LANES)                                    \
                for (size_t l = 0; l < SUMSQ_LANES; l++) {                                 \
                    double v = (double)x[i + l];                                           \
                    acc[l] = acc[l] + v * v;                                               \
                }                                                                          \
            for (size_t l = 0; l < n - m; l++) {                                           \
                double v = (double)x[m + l];                                               \
                acc[l] = acc[l] + v * v;                                                   \
            }                                                                              \
            double total = acc[0];                                                         \
            for (size_t l = 1; l < SUMSQ_LANES; l++) total = total + acc[l];               \
            out[r] = total;                                                                \
        }                                                                                  \
    }
SUMSQ(cn_sumsq32, float)
SUMSQ(cn_sumsq64, double)

/* Each row r of `rows` (at g + r*stride, n elements) times its factor f[r], in double, then
 * rounded to T: x = (T)((double)x * f[r]), what NumPy's `row *= numpy.float64(f)` computes
 * (the float widened exactly, one double product, one rounding to nearest). A factor of
 * exactly 1 leaves its row as it is (x * 1 is x), so such rows are not touched. Why: the
 * clip's scaling in NumPy takes its buffered float32 -> float64 -> float32 casting loop,
 * ~40 us at d = 10^5 against ~6 for this (learner.scale_rows). */
#define SCALE(NAME, T)                                                                      \
    void NAME(T *restrict g, size_t rows, size_t stride, size_t n,                         \
              const double *restrict f) {                                                  \
        for (size_t r = 0; r < rows; r++) {                                                \
            double a = f[r];                                                               \
            if (a == 1.0) continue;                                                        \
            T *x = g + r * stride;                                                         \
            for (size_t i = 0; i < n; i++) x[i] = (T)((double)x[i] * a);                   \
        }                                                                                  \
    }
SCALE(cn_scale32, float)
SCALE(cn_scale64, double)

#ifndef CN_NO_OPENSSL
/* A whole long row in C: the AES-128-CTR keystream from the system's OpenSSL (libcrypto, the
 * library `cryptography` also wraps; declared here so that no OpenSSL headers are needed),
 * generated a piece at a time into buffers that stay in cache, then the transform above —
 * no interpreter between chunks. The bytes are the kernel's row layout (cipher_noise): the
 * keystream of counter block `ctr0` on, chunk after chunk of `chunk` pairs, each chunk m
 * radius words then m angle words. Returns 0, 1 (a radius word below 2^below: the caller
 * recomputes the row) or -1 (an OpenSSL error). */
typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;
typedef struct evp_cipher_st EVP_CIPHER;
EVP_CIPHER_CTX *EVP_CIPHER_CTX_new(void);
void EVP_CIPHER_CTX_free(EVP_CIPHER_CTX *ctx);
const EVP_CIPHER *EVP_aes_128_ctr(void);
int EVP_EncryptInit_ex(EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, void *impl,
                       const unsigned char *key, const unsigned char *iv);
int EVP_EncryptUpdate(EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl,
                      const unsigned char *in, int inl);

#ifndef PIECE
#define PIECE 4096 /* pairs a piece: 32 KiB of radius words, 16 or 32 KiB of angle words (L2) */
#endif

static const unsigned char ZEROS[8 * PIECE]; /* the plaintext: CTR of zeros is the keystream */

/* Point ctx at byte `offset` of the row's keystream (the counter block holding it, then the
 * bytes before it within that block drawn and dropped); returns 0, or 1 on an error. */
static int seek(EVP_CIPHER_CTX *ctx, const uint8_t *ctr0, uint64_t offset) {
    uint8_t iv[16], drop[16];
    uint64_t block = offset / 16;
    int skip = (int)(offset % 16), len = 0;
    memcpy(iv, ctr0, 8); /* domain ‖ t: the row; the low 64 bits count blocks (big-endian) */
    for (int j = 0; j < 8; j++) iv[15 - j] = (uint8_t)(block >> (8 * j));
    if (EVP_EncryptInit_ex(ctx, NULL, NULL, NULL, iv) != 1) return 1;
    return skip && (EVP_EncryptUpdate(ctx, drop, &len, ZEROS, skip) != 1 || len != skip);
}

static int draw(EVP_CIPHER_CTX *ctx, uint8_t *buf, size_t n) {
    int len = 0;
    return EVP_EncryptUpdate(ctx, buf, &len, ZEROS, (int)n) != 1 || len != (int)n;
}

/* Two CTR contexts walk a chunk side by side — one through its radius words, one through
 * its angle words — a piece of each at a time, so both stay in cache and a context is
 * pointed anew only once a chunk. */
int cn_row(const uint8_t *key, const uint8_t *ctr0, size_t d, int f32, void *out,
           unsigned below, size_t chunk) {
    static _Thread_local uint8_t rbuf[8 * PIECE] __attribute__((aligned(64)));
    static _Thread_local uint8_t abuf[8 * PIECE] __attribute__((aligned(64)));
    EVP_CIPHER_CTX *cr = EVP_CIPHER_CTX_new(), *ca = EVP_CIPHER_CTX_new();
    int err = !cr || !ca || EVP_EncryptInit_ex(cr, EVP_aes_128_ctr(), NULL, key, ctr0) != 1
              || EVP_EncryptInit_ex(ca, EVP_aes_128_ctr(), NULL, key, ctr0) != 1;
    size_t pairs = (d + 1) / 2, asize = f32 ? 4 : 8;
    uint64_t at = 0, low = 0; /* the chunk's first keystream byte */
    for (size_t first = 0; first < pairs && !err; first += chunk) {
        size_t m = pairs - first < chunk ? pairs - first : chunk;
        size_t base = 2 * first, ns = d - base - m < m ? d - base - m : m;
        err = seek(cr, ctr0, at) || seek(ca, ctr0, at + 8 * m);
        for (size_t a = 0; a < m && !err; a += PIECE) {
            size_t k = m - a < PIECE ? m - a : PIECE;
            size_t nsk = ns > a ? (ns - a < k ? ns - a : k) : 0;
            err = draw(cr, rbuf, 8 * k) || draw(ca, abuf, asize * k);
            size_t item = f32 ? sizeof(float) : sizeof(double);
            char *o = (char *)out + base * item;
            low |= chunk_pairs(f32, (const uint64_t *)rbuf, abuf, k, o + a * item,
                               o + (m + a) * item, nsk, below);
        }
        at += (8 + asize) * m;
    }
    if (cr) EVP_CIPHER_CTX_free(cr);
    if (ca) EVP_CIPHER_CTX_free(ca);
    return err ? -1 : (low != 0);
}
#endif
