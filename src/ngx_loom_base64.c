
/*
 * Copyright (C) resty-loom authors
 *
 * Standard base64 (with padding) for resty.loom.publish, which encodes
 * every message's data in the request path. On x86-64 with AVX-512 VBMI,
 * 48 bytes become 64 characters per round; with SSSE3, 12 bytes become 16
 * (the pshufb method published by Wojciech Mula); elsewhere, and for the
 * tail, a 4096-entry table of character pairs turns each 3 bytes into two
 * 16-bit stores. A table alone
 * was 0.5 us per KiB when warm but twice that in a busy worker, whose
 * requests push the 8 KiB table out of the cache between messages.
 */


#include "ngx_loom.h"
#include <endian.h>

#if (defined __x86_64__ && defined __GNUC__)
#define LOOM_B64_SSSE3  1
#include <immintrin.h>
#endif


size_t ngx_loom_ffi_base64_encode(const u_char *src, size_t len,
    u_char *dst);


static const u_char  ngx_loom_b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* the two characters of every 12-bit value, in memory order */
static uint16_t  ngx_loom_b64_pairs[4096];
static ngx_uint_t  ngx_loom_b64_ready;


static void
ngx_loom_b64_init(void)
{
    ngx_uint_t  i;
    u_char     *p;

    for (i = 0; i < 4096; i++) {
        p = (u_char *) &ngx_loom_b64_pairs[i];
        p[0] = ngx_loom_b64_alphabet[i >> 6];
        p[1] = ngx_loom_b64_alphabet[i & 63];
    }

    ngx_loom_b64_ready = 1;
}


#if (LOOM_B64_SSSE3)

static ngx_int_t  ngx_loom_b64_has_ssse3 = -1;


/* encodes 12 bytes per round while 16 can be read; returns bytes consumed */
__attribute__((target("ssse3")))
static size_t
ngx_loom_b64_ssse3(const u_char *src, size_t len, u_char *dst)
{
    size_t   done;
    __m128i  in, t0, t1, t2, t3, idx, r, less;

    const __m128i  spread = _mm_set_epi8(10, 11, 9, 10, 7, 8, 6, 7,
                                         4, 5, 3, 4, 1, 2, 0, 1);
    /* what to add to a 6-bit value to get its character, by range */
    const __m128i  shift = _mm_setr_epi8('a' - 26, '0' - 52, '0' - 52,
                                         '0' - 52, '0' - 52, '0' - 52,
                                         '0' - 52, '0' - 52, '0' - 52,
                                         '0' - 52, '0' - 52, '+' - 62,
                                         '/' - 63, 'A', 0, 0);

    done = 0;

    while (len - done >= 16) {
        in = _mm_loadu_si128((const __m128i *) (src + done));

        /* each 3 bytes "a b c" as "b a c b", then the four 6-bit fields
         * moved into four bytes with two multiplies */
        in = _mm_shuffle_epi8(in, spread);
        t0 = _mm_and_si128(in, _mm_set1_epi32(0x0fc0fc00));
        t1 = _mm_mulhi_epu16(t0, _mm_set1_epi32(0x04000040));
        t2 = _mm_and_si128(in, _mm_set1_epi32(0x003f03f0));
        t3 = _mm_mullo_epi16(t2, _mm_set1_epi32(0x01000010));
        idx = _mm_or_si128(t1, t3);

        /* 0..25 -> 13, 26..51 -> 0, 52..61 -> 1..10, 62 -> 11, 63 -> 12 */
        r = _mm_subs_epu8(idx, _mm_set1_epi8(51));
        less = _mm_cmpgt_epi8(_mm_set1_epi8(26), idx);
        r = _mm_or_si128(r, _mm_and_si128(less, _mm_set1_epi8(13)));
        r = _mm_add_epi8(_mm_shuffle_epi8(shift, r), idx);

        _mm_storeu_si128((__m128i *) dst, r);
        dst += 16;
        done += 12;
    }

    return done;
}


/*
 * With AVX-512 VBMI, 48 bytes become 64 characters per round in three
 * instructions (Mula and Lemire, "Base64 encoding and decoding at almost
 * the speed of a memory copy", 2019): a byte permutation puts each 3
 * bytes as "b a c b", a multishift picks the four 6-bit fields, a second
 * permutation looks them up in the alphabet. A 1 KiB message costs a
 * tenth of the SSSE3 loop's instructions. Reads 64 bytes per round.
 */

static ngx_int_t  ngx_loom_b64_has_vbmi = -1;


__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static size_t
ngx_loom_b64_vbmi(const u_char *src, size_t len, u_char *dst)
{
    size_t   done;
    __m512i  v;

    const __m512i  spread = _mm512_setr_epi32(
        0x01020001, 0x04050304, 0x07080607, 0x0a0b090a,
        0x0d0e0c0d, 0x10110f10, 0x13141213, 0x16171516,
        0x191a1819, 0x1c1d1b1c, 0x1f201e1f, 0x22232122,
        0x25262425, 0x28292728, 0x2b2c2a2b, 0x2e2f2d2e);
    /* bit offsets of the four fields in each "b a c b" 32-bit lane */
    const __m512i  shifts = _mm512_set1_epi64(0x3036242a1016040aULL);
    const __m512i  alphabet = _mm512_loadu_si512(
                                  (const void *) ngx_loom_b64_alphabet);

    done = 0;

    while (len - done >= 64) {
        v = _mm512_loadu_si512((const void *) (src + done));
        v = _mm512_permutexvar_epi8(spread, v);
        v = _mm512_multishift_epi64_epi8(shifts, v);
        v = _mm512_permutexvar_epi8(v, alphabet);
        _mm512_storeu_si512((void *) dst, v);
        dst += 64;
        done += 48;
    }

    return done;
}

#endif


/* dst must have room for 4 * ((len + 2) / 3) bytes; returns bytes written */
size_t
ngx_loom_ffi_base64_encode(const u_char *src, size_t len, u_char *dst)
{
    uint32_t   v;
    uint64_t   w, o;
    u_char    *d;
    size_t     full;
    const u_char  *end;

    if (!ngx_loom_b64_ready) {
        ngx_loom_b64_init();
    }

    d = dst;

#if (LOOM_B64_SSSE3)
    if (ngx_loom_b64_has_vbmi == -1) {
        ngx_loom_b64_has_vbmi = __builtin_cpu_supports("avx512vbmi")
                                && __builtin_cpu_supports("avx512bw") ? 1 : 0;
    }

    if (ngx_loom_b64_has_vbmi && len >= 64) {
        full = ngx_loom_b64_vbmi(src, len, d);
        src += full;
        len -= full;
        d += full / 3 * 4;
    }

    if (ngx_loom_b64_has_ssse3 == -1) {
        ngx_loom_b64_has_ssse3 = __builtin_cpu_supports("ssse3") ? 1 : 0;
    }

    if (ngx_loom_b64_has_ssse3 && len >= 16) {
        full = ngx_loom_b64_ssse3(src, len, d);
        src += full;
        len -= full;
        d += full / 3 * 4;
    }
#endif

    full = len - len % 3;
    end = src + full;

    /* 6 bytes to 8 characters per round: one 8-byte load, one store */
    while (end - src >= 8) {
        ngx_memcpy(&w, src, 8);
        w = be64toh(w);
        o = (uint64_t) ngx_loom_b64_pairs[w >> 52]
            | (uint64_t) ngx_loom_b64_pairs[(w >> 40) & 4095] << 16
            | (uint64_t) ngx_loom_b64_pairs[(w >> 28) & 4095] << 32
            | (uint64_t) ngx_loom_b64_pairs[(w >> 16) & 4095] << 48;
        o = htole64(o);
        ngx_memcpy(d, &o, 8);
        src += 6;
        d += 8;
    }

    while (src < end) {
        v = ((uint32_t) src[0] << 16) | ((uint32_t) src[1] << 8) | src[2];
        ngx_memcpy(d, &ngx_loom_b64_pairs[v >> 12], 2);
        ngx_memcpy(d + 2, &ngx_loom_b64_pairs[v & 4095], 2);
        src += 3;
        d += 4;
    }

    switch (len - full) {

    case 2:
        v = ((uint32_t) src[0] << 16) | ((uint32_t) src[1] << 8);
        ngx_memcpy(d, &ngx_loom_b64_pairs[v >> 12], 2);
        d[2] = ngx_loom_b64_alphabet[(v >> 6) & 63];
        d[3] = '=';
        d += 4;
        break;

    case 1:
        v = (uint32_t) src[0] << 16;
        ngx_memcpy(d, &ngx_loom_b64_pairs[v >> 12], 2);
        d[2] = '=';
        d[3] = '=';
        d += 4;
        break;
    }

    return d - dst;
}
