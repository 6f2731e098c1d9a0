/* e^x for loops that must vectorize (libm's expf does not without -ffast-math), shared by the C kernels.
 * Included by each kernel source; engine/cpu_kernels.py hashes the headers into each build's key. */
#ifndef TANDEM_VEXP_H
#define TANDEM_VEXP_H

#include <stdint.h>
#include <string.h>

/* The pieces of e^x = 2^n e^r, x = n ln2 + r, |r| <= ln2/2, shared by the scalar vexp below and the kernels'
 * vector forms (prefill_attention.c): n = round(x / ln2) by the 1.5 * 2^23 trick (the sum's low mantissa
 * bits hold n), r in two parts of ln2, e^r by a degree-6 polynomial. VEXP_POLY is an expression valid for a
 * float or a float vector r, evaluated in one fixed order. */
#define VEXP_LOG2E 1.44269504088896341f
#define VEXP_SHIFT 12582912.0f
#define VEXP_LN2_HI 0.693359375f
#define VEXP_LN2_LO 2.12194440e-4f
#define VEXP_POLY(r)                                                                                   \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) \
        * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

/* e^x to about 1 ulp, written so that loops over it vectorize (libm's expf does not without
 * -ffast-math); 2^n from the exponent bits. */
static inline float vexp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float shifted = x * VEXP_LOG2E + VEXP_SHIFT, n = shifted - VEXP_SHIFT;
    uint32_t n_bits;
    memcpy(&n_bits, &shifted, sizeof n_bits);
    const float r = (x - n * VEXP_LN2_HI) + n * VEXP_LN2_LO;
    const float p = VEXP_POLY(r);
    const uint32_t bits = ((n_bits - 0x4b400000u) + 127u) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
