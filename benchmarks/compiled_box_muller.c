/* Box–Muller on a keystream, compiled: the floor of issue 34's draw target measured a way
 * NumPy cannot reach (one fused pass, glibc's libmvec AVX2 log/sin/cos).
 * Built and timed by benchmarks/compiled_noise_floor.py; not part of the package.
 *
 * Pair i reads a radius word rw[i] and an angle word aw[i] (the kernel's bytes: 8 + 4 a
 * float32 pair, 8 + 8 a float64 pair); u = (63 or 53 top bits + ½)·2⁻ᵇ, never 0, so no
 * refill branch (the library's kernel refills the ≈ 2⁻³¹ radius words below 2³²).
 * Loops are kept separate so that GCC vectorizes each (a joint sin/cos becomes a scalar
 * sincosf call). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

void bm32(const uint64_t *restrict rw, const uint32_t *restrict aw, float *restrict oc,
          float *restrict os, float *restrict r, size_t m) {
    for (size_t i = 0; i < m; i++) { /* 62 bits of u as two exact int32 → float parts */
        float hi = (float)(int32_t)(rw[i] >> 33);              /* top 31 bits */
        float lo = (float)(int32_t)((rw[i] >> 2) & 0x7FFFFFFF); /* next 31 bits */
        float u = hi * 0x1p-31f + (lo * 0x1p-62f + 0x1p-63f);
        r[i] = sqrtf(-2.0f * logf(u));
    }
    const float a = 6.2831853071795865f * 0x1p-24f;
    for (size_t i = 0; i < m; i++) oc[i] = r[i] * cosf((float)(int32_t)(aw[i] >> 8) * a);
    for (size_t i = 0; i < m; i++) os[i] = r[i] * sinf((float)(int32_t)(aw[i] >> 8) * a);
}

void bm64(const uint64_t *restrict rw, const uint64_t *restrict aw, double *restrict oc,
          double *restrict os, double *restrict r, double *restrict t, size_t m) {
    for (size_t i = 0; i < m; i++) { /* 53 bits of u: 31 + 22, each an exact int32 */
        double hi = (double)(int32_t)(rw[i] >> 33);
        double lo = (double)(int32_t)((rw[i] >> 11) & 0x3FFFFF);
        double u = hi * 0x1p-31 + (lo * 0x1p-53 + 0x1p-54);
        r[i] = sqrt(-2.0 * log(u));
        double ah = (double)(int32_t)(aw[i] >> 33), al = (double)(int32_t)((aw[i] >> 11) & 0x3FFFFF);
        t[i] = (ah * 0x1p-31 + al * 0x1p-53) * 6.283185307179586;
    }
    for (size_t i = 0; i < m; i++) oc[i] = r[i] * cos(t[i]);
    for (size_t i = 0; i < m; i++) os[i] = r[i] * sin(t[i]);
}

/* A whole row in C: AES-128-CTR keystream (OpenSSL's EVP, one chunk at a time into a
 * buffer that stays in cache) and the transform above, no Python between chunks — the
 * floor without the interpreter. Returns 0 on success. */
#include <openssl/evp.h>
#include <string.h>

#define ROW_CHUNK 4096 /* pairs */

static int keystream(EVP_CIPHER_CTX *ctx, unsigned char *buf, int n) {
    static const unsigned char zeros[16 * ROW_CHUNK];
    int len = 0;
    return EVP_EncryptUpdate(ctx, buf, &len, zeros, n) == 1 && len == n ? 0 : -1;
}

int row_c(const unsigned char *key, const unsigned char *iv, void *out, size_t d, int f32) {
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (!ctx || EVP_EncryptInit_ex(ctx, EVP_aes_128_ctr(), NULL, key, iv) != 1) return -1;
    static unsigned char ks[16 * ROW_CHUNK];
    static double r[ROW_CHUNK], t[ROW_CHUNK], tail[ROW_CHUNK];
    size_t lo = 0;
    int rc = 0;
    while (lo < d && rc == 0) {
        size_t m = (d - lo + 1) / 2;
        if (m > ROW_CHUNK) m = ROW_CHUNK;
        size_t sn = (d - lo - m < m) ? d - lo - m : m;
        int word = f32 ? 12 : 16;
        rc = keystream(ctx, ks, (int)(word * m));
        if (f32) {
            float *o = (float *)out + lo;
            float *os = (sn < m) ? (float *)tail : o + m;
            bm32((const uint64_t *)ks, (const uint32_t *)(ks + 8 * m), o, os, (float *)r, m);
            if (sn < m) memcpy(o + m, tail, sn * sizeof(float));
        } else {
            double *o = (double *)out + lo;
            double *os = (sn < m) ? tail : o + m;
            bm64((const uint64_t *)ks, (const uint64_t *)(ks + 8 * m), o, os, r, t, m);
            if (sn < m) memcpy(o + m, tail, sn * sizeof(double));
        }
        lo += m + sn;
    }
    EVP_CIPHER_CTX_free(ctx);
    return rc;
}
