/* The window split of shared/planes.py in compiled passes, so that a chunk costs one foreign call
 * made without the interpreter lock (ctypes releases it) instead of ~30 numpy calls that each take
 * the lock back. Same bytes as the numpy code (tests/test_planes.py); shared/planes.py says what
 * the split is, calls this only on a little-endian machine, and falls back to numpy where this
 * does not build.
 *
 * Rows of an even length (every feature array: layers x hidden) go two values at a time, whose
 * pair shares one byte of offsets: 32-bit lanes the compiler vectorizes. Odd rows take a plain
 * loop per value. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TOP 14

static uint32_t ld32(const void *p) { uint32_t x; memcpy(&x, p, 4); return x; }
static uint16_t ld16(const void *p) { uint16_t x; memcpy(&x, p, 2); return x; }
static void st32(void *p, uint32_t x) { memcpy(p, &x, 4); }
static void st16(void *p, uint16_t x) { memcpy(p, &x, 2); }

/* The values before the chunk's trailing rows of zeros (which are not stored). */
int64_t window_used(const uint16_t *v, int64_t n, int64_t row) {
    int64_t i = n;
    while (i > 0 && v[i - 1] == 0) i--;
    return row ? (i + row - 1) / row * row : 0;
}

/* v: k values (k = rows x row). Writes plane (row column bases, then (k + 1) / 2 bytes of two
 * 4-bit offsets, first << 4 | second), pb (k bytes: sign at bit 7, mantissa below) and the escapes
 * in flat order (esc_idx: little-endian uint32 bytes; esc_exp: exponents; room for k of each).
 * Scratch: lo (row bytes), cols (row uint32), nib (k bytes; odd rows). Returns the escape count. */
int64_t window_encode(const uint16_t *v, int64_t k, int64_t row, uint8_t *plane, uint8_t *pb,
                      uint8_t *esc_idx, uint8_t *esc_exp, uint8_t *lo, uint32_t *cols, uint8_t *nib) {
    uint8_t *base = plane, *packed = plane + row;
    int64_t rows = row ? k / row : 0, n_esc = 0;
    for (int64_t c = 0; c < row; c++) base[c] = 0, lo[c] = 255;
    for (int64_t r = 0; r < rows; r++) {  /* each column's top and bottom exponent */
        const uint16_t *x = v + r * row;
        for (int64_t c = 0; c < row; c++) {
            uint8_t e = (uint8_t)(x[c] >> 7);
            base[c] = e > base[c] ? e : base[c];
            lo[c] = e < lo[c] ? e : lo[c];
        }
    }
    for (int64_t c = 0; c < row; c++) base[c] = (uint8_t)((base[c] > TOP ? base[c] : TOP) - TOP);
    if (row % 2 == 0) {  /* offsets (an escape's nibble is set below), sign and mantissa */
        int64_t h = row / 2;
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *x = v + r * row;
            uint8_t *p = packed + r * h, *s = pb + r * row;
            for (int64_t j = 0; j < h; j++) {
                uint32_t w = ld32(x + 2 * j), b = ld16(base + 2 * j);
                uint32_t o0 = ((w >> 7) - b) & 15, o1 = ((w >> 23) - (b >> 8)) & 15;
                p[j] = (uint8_t)(o0 << 4 | o1);
                st16(s + 2 * j, (uint16_t)(((w >> 8) & 0x80) | (w & 0x7F) | ((w >> 16) & 0x8000) | ((w >> 8) & 0x7F00)));
            }
        }
    } else {
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *x = v + r * row;
            for (int64_t c = 0; c < row; c++) {
                uint16_t u = x[c];
                nib[r * row + c] = (uint8_t)(((u >> 7) - base[c]) & 15);
                pb[r * row + c] = (uint8_t)(((u >> 8) & 0x80) | (u & 0x7F));
            }
        }
        for (int64_t j = 0; j < k / 2; j++) packed[j] = (uint8_t)(nib[2 * j] << 4 | nib[2 * j + 1]);
        if (k % 2) packed[k / 2] = (uint8_t)(nib[k - 1] << 4);
    }
    /* escapes: exponents below their column's base, looked for only in the columns whose bottom
     * is, row by row so that they come in flat order; their nibble is 15 */
    int64_t n_cols = 0;
    for (int64_t c = 0; c < row; c++)
        if (lo[c] < base[c]) cols[n_cols++] = (uint32_t)c;
    for (int64_t r = 0; r < rows && n_cols; r++) {
        const uint16_t *x = v + r * row;
        for (int64_t j = 0; j < n_cols; j++) {
            uint32_t c = cols[j];
            uint8_t e = (uint8_t)(x[c] >> 7);
            if (e < base[c]) {
                uint32_t i = (uint32_t)(r * row + c);
                st32(esc_idx + 4 * n_esc, i);  /* (little-endian: planes.py checks) */
                esc_exp[n_esc++] = e;
                packed[i >> 1] |= (i & 1) ? 0x0F : 0xF0;
            }
        }
    }
    return n_esc;
}

/* The k values into res from plane (bases, then the packed offsets), the escapes (as encoded) and
 * pb. Returns 0, or -1 (nothing written) for an escape's index past the values. */
int window_decode(const uint8_t *plane, const uint8_t *esc_idx, const uint8_t *esc_exp, int64_t n_esc,
                  const uint8_t *pb, int64_t k, int64_t row, uint16_t *res) {
    const uint8_t *base = plane, *packed = plane + row;
    int64_t rows = row ? k / row : 0;
    for (int64_t j = 0; j < n_esc; j++)
        if (ld32(esc_idx + 4 * j) >= (uint64_t)k) return -1;
    if (row % 2 == 0) {
        int64_t h = row / 2;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *p = packed + r * h, *s = pb + r * row;
            uint16_t *y = res + r * row;
            for (int64_t j = 0; j < h; j++) {
                uint32_t b = p[j], bp = ld16(base + 2 * j), sp = ld16(s + 2 * j);
                uint32_t e0 = (bp + (b >> 4)) & 0xFF, e1 = ((bp >> 8) + (b & 15)) & 0xFF;
                uint32_t y0 = e0 << 7 | (sp & 0x7F) | (sp & 0x80) << 8;
                uint32_t y1 = e1 << 7 | ((sp >> 8) & 0x7F) | (sp & 0x8000);
                st32(y + 2 * j, y0 | y1 << 16);
            }
        }
    } else {
        for (int64_t i = 0; i < k; i++) {
            uint8_t b = packed[i >> 1], off = (i & 1) ? (b & 15) : (b >> 4);
            uint8_t e = (uint8_t)(base[i % row] + off), sm = pb[i];
            res[i] = (uint16_t)((uint16_t)e << 7 | (sm & 0x7F) | (uint16_t)(sm & 0x80) << 8);
        }
    }
    for (int64_t j = 0; j < n_esc; j++) {
        uint32_t i = ld32(esc_idx + 4 * j);
        res[i] = (uint16_t)((res[i] & 0x807F) | (uint16_t)esc_exp[j] << 7);
    }
    return 0;
}
