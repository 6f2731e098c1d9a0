/* e^x for loops that must vectorize (libm's expf does not without -ffast-math), shared by the C kernels.
 * Included by each kernel source; engine/cpu_kernels.py hashes the headers into each build's key. */
#ifndef TANDEM_VEXP_H
#define TANDEM_VEXP_H

#include <stdint.h>
#include <string.h>

/* e^x to about 1 ulp, written so that loops over it vectorize (libm's expf does not without
 * -ffast-math): x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n by the exponent bits. */
static inline float vexp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick: the sum's low mantissa bits hold n */
    const float shifted = x * 1.44269504088896341f + 12582912.0f, n = shifted - 12582912.0f;
    uint32_t n_bits;
    memcpy(&n_bits, &shifted, sizeof n_bits);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = ((n_bits - 0x4b400000u) + 127u) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
