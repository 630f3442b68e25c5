/* bf16 -> the releases' FP8 (e4m3, ue8m0 per br x bc block: V4 128x128, V4.1 32x32 and 1x32)
 * / FP4 (e2m1, ue8m0 per 32 inputs of a row) in one pass per block: native_quant.py compiles it
 * on first use and calls it through ctypes (the GIL is released, so export threads run it in
 * parallel). It is the algorithm of fp8_fp4._quantize_bf16, element for element, so the codes
 * are its codes (tested over every bf16 pattern):
 *   top   = the block's largest pattern without its sign bit (it orders like |x|);
 *   e     = ((top + carry) >> 7) - bias, clamped to [-127, 127] (the smallest power of two
 *           with max |x| / 2^e <= limit, see _Bf16Format);
 *   y     = x / 2^e as a bf16 pattern: the pattern plus -e << 7 when e is in [lowest, 0] or the
 *           block is all zero (shift clamped to -lowest), else bf16(float(x) * 2^-e);
 *   code  = table[y] (fp8_fp4._bf16_code_table; FP4 computes the same codes, fp4_pack),
 *           FP4 two per byte, the even one low.
 * Returns the number of blocks holding NaN or inf (their outputs are left unspecified).
 */
#include <stdint.h>
#include <string.h>

static inline float power_of_two(int e) { /* 2^e for e in [-127, 127], exactly */
    uint32_t u = e >= -126 ? (uint32_t)(e + 127) << 23 : (uint32_t)1 << 22;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t multiplied(uint16_t x, float inverse) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    f *= inverse; /* exact unless it underflows; then far below the smallest code either way */
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even bf16, as torch's bf16 product */
    return (uint16_t)(u >> 16);
}

/* The block's largest pattern without its sign bit (as int16: SSE2 has a signed 16-bit max). */
static inline int block_top(const uint16_t *v, int64_t len) {
    int16_t top = 0;
    for (int64_t j = 0; j < len; ++j) {
        int16_t m = (int16_t)(v[j] & 0x7FFF);
        top = m > top ? m : top;
    }
    return top;
}

/* What x / 2^e adds to a pattern when the exponent field can move (e in [lowest, 0], or an
 * all-zero block: shift clamped to -lowest), else -1 (multiply instead). */
static inline int pattern_add(int e, int top, int lowest) {
    if (top != 0 && (e < lowest || e > 0)) return -1;
    return (-e < -lowest ? -e : -lowest) << 7;
}

/* y[j] = the pattern of v[j] / 2^e (see the header), len values. */
static inline void scale_block(const uint16_t *v, int64_t len, int e, int top, int lowest,
                               uint16_t *y) {
    const int add = pattern_add(e, top, lowest);
    if (add >= 0) {
        for (int64_t j = 0; j < len; ++j) y[j] = (uint16_t)(v[j] + add);
    } else {
        float inverse = power_of_two(-e);
        for (int64_t j = 0; j < len; ++j) y[j] = multiplied(v[j], inverse);
    }
}

static inline int exponent_of(int top, int carry, int bias) {
    int e = ((top + carry) >> 7) - bias;
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

/* e2m1 codes of 32 scaled patterns (|y| <= 6), two per byte, the even one low. With SSE2 (every
 * x86-64) by arithmetic, 8 lanes of 16 bits, the table's values (checked against it for every
 * pattern): from 1 up, rounding the 7 mantissa bits to 1 (nearest, ties to even) counts codes
 * 2..7; below 1 the grid is 0, 0.5, 1 with its ties at 0.25 (down) and 0.75 (up); bit 3 is the
 * sign. Elsewhere (or built with -DQUANT_BF16_PORTABLE, as a test does) by the table. */
#if defined(__SSE2__) && !defined(QUANT_BF16_PORTABLE)
#include <emmintrin.h>
static inline __m128i fp4_codes8(__m128i y) {
    const __m128i m = _mm_and_si128(y, _mm_set1_epi16(0x7FFF));
    const __m128i mc = _mm_max_epi16(_mm_min_epi16(m, _mm_set1_epi16(0x40C0)),
                                     _mm_set1_epi16(0x3F80));
    __m128i q = _mm_and_si128(_mm_srli_epi16(mc, 6), _mm_set1_epi16(1));
    q = _mm_srli_epi16(_mm_add_epi16(_mm_add_epi16(mc, _mm_set1_epi16(0x1F)), q), 6);
    q = _mm_sub_epi16(q, _mm_set1_epi16(0xFC));
    q = _mm_add_epi16(q, _mm_cmpgt_epi16(_mm_set1_epi16(0x3F40), m)); /* -1 below 0.75 */
    q = _mm_add_epi16(q, _mm_cmpgt_epi16(_mm_set1_epi16(0x3E81), m)); /* -1 up to 0.25 */
    return _mm_or_si128(q, _mm_and_si128(_mm_srli_epi16(y, 12), _mm_set1_epi16(8)));
}

/* 8 codes (16-bit lanes) -> 4 packed bytes in the low byte of each 32-bit lane. */
static inline __m128i fp4_pairs(__m128i c) {
    return _mm_and_si128(_mm_or_si128(c, _mm_srli_epi32(c, 12)), _mm_set1_epi32(0xFF));
}

/* 32 scaled patterns in 4 vectors -> 16 packed bytes at o. */
static inline void fp4_store(const __m128i y[4], uint8_t *o) {
    __m128i p[4];
    for (int i = 0; i < 4; ++i) p[i] = fp4_pairs(fp4_codes8(y[i]));
    const __m128i lo = _mm_packs_epi32(p[0], p[1]), hi = _mm_packs_epi32(p[2], p[3]);
    _mm_storeu_si128((__m128i *)o, _mm_packus_epi16(lo, hi));
}

/* One group of 32 inputs: its exponent into *e, its 16 bytes into o; 1 if it holds NaN/inf. */
static inline int fp4_group(const uint16_t *v, int carry, int bias, int lowest, uint8_t *o,
                            int32_t *e_out) {
    const __m128i mask = _mm_set1_epi16(0x7FFF);
    __m128i a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm_loadu_si128((const __m128i *)(v + 8 * i));
    __m128i mx = _mm_max_epi16(_mm_max_epi16(_mm_and_si128(a[0], mask), _mm_and_si128(a[1], mask)),
                               _mm_max_epi16(_mm_and_si128(a[2], mask), _mm_and_si128(a[3], mask)));
    mx = _mm_max_epi16(mx, _mm_srli_si128(mx, 8));
    mx = _mm_max_epi16(mx, _mm_srli_si128(mx, 4));
    mx = _mm_max_epi16(mx, _mm_srli_si128(mx, 2));
    const int top = _mm_extract_epi16(mx, 0);
    const int e = exponent_of(top, carry, bias);
    *e_out = e;
    const int add = pattern_add(e, top, lowest);
    if (add >= 0) {
        const __m128i by = _mm_set1_epi16((short)add);
        for (int i = 0; i < 4; ++i) a[i] = _mm_add_epi16(a[i], by);
    } else {
        uint16_t y[32];
        scale_block(v, 32, e, top, lowest, y);
        for (int i = 0; i < 4; ++i) a[i] = _mm_loadu_si128((const __m128i *)(y + 8 * i));
    }
    fp4_store(a, o);
    return top >= 0x7F80;
}
#define FP4_SSE2 1
#else
#define FP4_SSE2 0
#endif

int64_t quantize_fp4_bf16(const uint16_t *x, int64_t n, int64_t k, int carry, int bias,
                          int lowest, const uint8_t *table, uint8_t *out, int32_t *exponent) {
    int64_t bad = 0;
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            const uint16_t *v = x + r * k + g * 32;
            uint8_t *o = out + r * (k / 2) + g * 16;
#if FP4_SSE2
            (void)table;
            bad += fp4_group(v, carry, bias, lowest, o, exponent + r * groups + g);
#else
            uint16_t y[32];
            int top = block_top(v, 32);
            bad += top >= 0x7F80;
            int e = exponent_of(top, carry, bias);
            exponent[r * groups + g] = e;
            scale_block(v, 32, e, top, lowest, y);
            for (int j = 0; j < 16; ++j)
                o[j] = (uint8_t)(table[y[2 * j]] | (table[y[2 * j + 1]] << 4));
#endif
        }
    }
    return bad;
}

/* V4's 128x128 blocks, the constant compiled in. */
int64_t quantize_fp8_bf16(const uint16_t *x, int64_t n, int64_t k, int carry, int bias,
                          int lowest, const uint8_t *table, uint8_t *out, int32_t *exponent,
                          int32_t *top /* scratch: k / 128 */) {
    int64_t bad = 0;
    const int64_t kb = k / 128;
    uint16_t y[128];
    for (int64_t b = 0; b < n / 128; ++b) {
        for (int64_t c = 0; c < kb; ++c) top[c] = 0;
        for (int64_t r = b * 128; r < (b + 1) * 128; ++r)
            for (int64_t c = 0; c < kb; ++c) {
                int t = block_top(x + r * k + c * 128, 128);
                top[c] = t > top[c] ? t : top[c];
            }
        for (int64_t c = 0; c < kb; ++c) {
            bad += top[c] >= 0x7F80;
            exponent[b * kb + c] = exponent_of(top[c], carry, bias);
        }
        for (int64_t r = b * 128; r < (b + 1) * 128; ++r)
            for (int64_t c = 0; c < kb; ++c) {
                scale_block(x + r * k + c * 128, 128, exponent[b * kb + c], top[c], lowest, y);
                uint8_t *o = out + r * k + c * 128;
                for (int j = 0; j < 128; ++j) o[j] = table[y[j]];
            }
    }
    return bad;
}

/* Any br x bc blocks (V4.1: 32x32 dense weights, 1x32 Engram rows): quantize_fp8_bf16 above
 * with the block as arguments (that one keeps its constant 128 for V4's speed). A block's
 * columns are scaled 128 at a time: y is stack scratch of a fixed size. */
int64_t quantize_fp8_bf16_blocks(const uint16_t *x, int64_t n, int64_t k, int64_t br,
                                 int64_t bc, int carry, int bias, int lowest,
                                 const uint8_t *table, uint8_t *out, int32_t *exponent,
                                 int32_t *top /* scratch: k / bc */) {
    int64_t bad = 0;
    const int64_t kb = k / bc;
    uint16_t y[128];
    for (int64_t b = 0; b < n / br; ++b) {
        for (int64_t c = 0; c < kb; ++c) top[c] = 0;
        for (int64_t r = b * br; r < (b + 1) * br; ++r)
            for (int64_t c = 0; c < kb; ++c) {
                int t = block_top(x + r * k + c * bc, bc);
                top[c] = t > top[c] ? t : top[c];
            }
        for (int64_t c = 0; c < kb; ++c) {
            bad += top[c] >= 0x7F80;
            exponent[b * kb + c] = exponent_of(top[c], carry, bias);
        }
        for (int64_t r = b * br; r < (b + 1) * br; ++r)
            for (int64_t c = 0; c < kb; ++c)
                for (int64_t j0 = 0; j0 < bc; j0 += 128) {
                    const int64_t len = bc - j0 < 128 ? bc - j0 : 128;
                    const int64_t at = r * k + c * bc + j0;
                    scale_block(x + at, len, exponent[b * kb + c], top[c], lowest, y);
                    for (int64_t j = 0; j < len; ++j) out[at + j] = table[y[j]];
                }
    }
    return bad;
}
