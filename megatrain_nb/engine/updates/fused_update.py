"""The compressed update in one pass: decode, AdamW, encode, fused in a small C kernel.

Today's torch path (``codecs.py``) runs each moment chunk through some fifteen torch ops per
direction, each a pass over memory, and AdamW between them: at ~0.1-0.2x the fused fp32 AdamW's
parameters/s it made the compressed update the slowest part of a step. This module compiles one
C file (:data:`SOURCE`) with the machine's C compiler and loads it with ``ctypes``:

* ``mt_encode`` / ``mt_decode``: the four block codecs of ``codecs.py`` (int8 and int4,
  ``exp_avg`` and ``exp_avg_sq``), one pass, each block in registers and L1;
* ``mt_update``: a chunk of a unit's update -- each block's moments decoded, AdamW on its
  weights and gradient, the new moments encoded -- with no fp32 moments in memory. With AVX2 and
  FMA a step of 256 values (one int8 block, 8 int4 ones) is two passes over L1 arrays: (A) the
  codes decoded straight into AdamW's 8-float lanes, the new moments and their block maxima (no
  root: multiplies, conversions, permutes); (B) AdamW's root and division on the weights and each
  block encoded from its known maximum in the same loop, the second moment's first root being
  AdamW's (``sqrtf`` is monotone: ``sqrtf(max(v, floor)) = max(sqrtf(v), sqrtf(floor))``): three
  roots and a division per 8 values, the divider's work together; int8 runs a step's pass A inside
  the previous step's pass B, 8 values of each in turn, so that the multiplies of one fill the
  divider's waits of the other. Before (issue 45) the cut was elsewhere (decode, moments, root and
  division in one loop, whose dependent chain of ~70 cycles per 8 values held more of it in flight
  than Zen 3's scheduler does; then the encoders' roots alone): the new cut measured int8 +9.9%,
  int4 +8.5% on the benchmark's chain (in one process, alternating, 8 rounds of 4194304
  parameters on one thread, load ~4.3 on 2 cores: int8 519 -> 557 M params/s, int4 424 -> 457,
  the fp32 AdamW 957-1116), the kernel alone +8-10% and +9%; int8's interleave of two steps
  another +9.5% on the chain (553 -> 633 and 626 -> 687 M params/s, load ~2.9) and +15% over
  the first cut's kernel alone; int4's codes decoded by byte shuffles of the levels' byte planes
  instead of AVX2 lane permutes (``vpermps``: ~1.3 cycles each on Zen 3, and slowed by the divider's
  work beside it, where ``vpshufb`` is not) +2-5% (613 and 621 M params/s against 595 and 593 on
  the thread's CPU time, load ~4.2). All together, the kernel alone against the one before them
  (thread CPU time, 11 rounds, load ~4.6): int8 873 against 740 M params/s, int4 658-660 against
  544-567 (+19-20%). Tried beside it and not kept (same A/B): the interleave a block
  (32 values) of each at a time (int8 +2-6%), int4's interleave (8 values: -4 to -7%; a block:
  -11%; with the byte shuffles, within +-8%), pass B cut again (roots; division and the second
  moment's code: -6% both), the encoders' roots from ``vrsqrtps``, a Goldschmidt step and the
  exact residual (equal to the IEEE root on every float >= 2**-102 here, all 2.1e9 checked; int8
  +2-5% for the first moment's root, -6% for the fourth root's, int4 -5%: not worth an exactness
  that rests on one CPU's ``rsqrt`` table), ``-fschedule-insns`` (no change). Steps at a group's
  edge, in torch's scalar tail, with a lerp from the gradient, where the decay ends, on a floored scale,
  the first one, and every step without AVX2 take the general path (each block decoded into L1
  buffers, AdamW, encoded; int4: 8 blocks at a time, their scale roots as one vector). The same
  arithmetic per value either way (tests/engine/test_fused_update_simd.py);
* ``mt_adamw``: torch's fused AdamW over flat fp32 buffers, bit for bit, with one division
  fewer (the one by the constant ``sqrt(1 - beta2**t)`` is a multiply and an exact residual
  step, which rounds the same: Markstein's theorem; checked over 2·10**8 operands).

Each entry point can split its range over pthreads of its own, in whole blocks; the engine
instead cuts a range in pieces on its :class:`UpdateTeam` (``EngineConfig.optimizer_threads``:
the AdamW worker and its ``mtnb-update`` helpers; a compressed chunk's also the two codec
threads ``mtnb-decode`` and ``mtnb-encode``) and calls each piece on one thread. The scalars
carry absolute indices (weight decay's end, torch's scalar tail, a learning-rate group's
``[lo, hi)``: :func:`group_args`), so no result depends on the split.

What it computes. The arithmetic is the torch path's op for op (the same roundings, every fused
multiply-add where torch's kernels fuse one, none elsewhere), with one difference: ``sqrt`` is
the IEEE, correctly rounded square root. torch's ``sqrt`` on a CPU tensor is MKL's ``vsSqrt``,
which returns the float below the correctly rounded result for ~0.5% of inputs (measured over
all 2**31 positive floats); with it substituted by the IEEE one, the torch path's codes and
scales equal this kernel's bit for bit (tests/engine/test_codecs.py). A 1-ulp difference in a
root moves a code only where the value sits within an ulp of a code boundary: 2 of 1.3·10**8
codes differed (benchmarks/bench_update_speed.py counts them), each one level apart, within
the codec's documented error. Decoding has no root: its values are
the torch path's bit for bit. AdamW is ``torch._fused_adamw_``'s, bit for bit, including its
scalar tail (the last ``numel % Vec::size()`` elements of each call, whose second moment torch
rounds differently); the engine's chunked update therefore gives the weights and codes of the
torch path's chunked update, whatever the chunk size.

When. :func:`kernels` compiles on first use (never at import), once per machine and source:
the shared library is cached under ``$MEGATRAIN_NB_CACHE`` (else ``~/.cache/megatrain_nb``)
``/kernels/``, keyed by the source, the flags, the compiler's version and the CPU's flags
(``-march=native`` code never runs on another CPU), written atomically. Before it is used it
checks itself against torch on a few thousand values (decode equal, codes equal or one level
apart, AdamW equal and torch's vector width found); a machine without a C compiler, a failed
build or a failed check leaves the torch path in place, said once in a log line (logger
``megatrain_nb.engine.updates.fused_update``). ``MEGATRAIN_NB_FUSED_UPDATE=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Dict, Optional

import torch

from ...threads import UPDATE, executor

log = logging.getLogger(__name__)

__all__ = ["ALL", "AdamArgs", "CodedChunk", "FLAGS", "Kernels", "SOLO", "SOURCE", "UpdateTeam", "adam_args",
           "cache_dir", "chunk_views", "disabled_reason", "encode_error", "group_args", "kernels", "torch_path"]

#: The C source of the kernels.
SOURCE = r"""/* megatrain_nb's fused optimizer-state kernels (see megatrain_nb/engine/updates/fused_update.py).
   Plain C: built with -ffp-contract=off (every fused multiply-add below is an explicit fmaf, so
   the arithmetic is the torch path's, op for op) and without -ffast-math (no flush-to-zero: the
   codecs' subnormal handling depends on it). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(MT_NO_SIMD)
#include <immintrin.h>
#define MT_AVX512 1
#else
#define MT_AVX512 0
#endif
#if !MT_AVX512 && defined(__AVX2__) && !defined(MT_NO_SIMD)
#include <immintrin.h>
#define MT_AVX2 1
#else
#define MT_AVX2 0
#endif
/* the fused step's 8 lanes (AVX2 and FMA: the AVX-512 CPUs' code too) */
#if defined(__AVX2__) && defined(__FMA__) && !defined(MT_NO_SIMD)
#include <immintrin.h>
#define MT_V8 1
#else
#define MT_V8 0
#endif

#include <pthread.h>

#define I8B 256
#define I4B 32

typedef struct {
    /* codec constants, computed by Python exactly as the torch path rounds them */
    float i8m_floor, i8v_floor, i4v_floor;  /* (under/levels)**(2**roots) as float */
    float dither_alpha, inv127, inv255, tiny_scale;
    float lut4m[16], lut4v[16];
} consts_t;

typedef struct {
    float coef, pmul, b2, c2, bc2s, eps, negss;
    int32_t lerp_from_grad;          /* torch's lerp: base = grad when |1 - beta1| >= 0.5 */
    int64_t decay_end;               /* absolute index: elements below it are decayed (pmul) */
    int64_t tail[4];                 /* two absolute ranges [lo, hi) on torch's scalar path */
    int64_t lo, hi;                  /* the absolute elements these scalars step (a learning-rate group) */
} adam_t;

enum { BAD_NEGATIVE = 1, BAD_NONFINITE = 2 };

static inline int32_t bits_of(float x) { int32_t b; memcpy(&b, &x, 4); return b; }

/* max |x| of a block; NaN when one is NaN (torch.amax's). The bit patterns of non-negative
   floats sort as integers (NaN above inf), so this is an integer max, which vectorises. */
static inline float absmax(const float *restrict x, int n) {
    int32_t mx = 0;
    for (int i = 0; i < n; i++) { int32_t a = bits_of(x[i]) & 0x7fffffff; mx = a > mx ? a : mx; }
    float s; memcpy(&s, &mx, 4);
    return s;
}

/* ------------------------------------------------------------------ block encoders */
/* _root_levels: levels * (x / mx) ** (1 / 2**roots) as root(max(x, floor)) * k. */
static inline void scale_setup(float mx, float levels, float floor_coef, int roots,
                               float *mx_out, float *mul_out, float *k_out, float *floor_out) {
    float mul = 1.0f;
    if (mx < 0x1p-60f && mx > 0.0f) { mul = 0x1p64f; mx = mx * mul; }   /* _normal_blocks (exact) */
    float k = mx < 0x1p-149f ? 0x1p-149f : mx;
    if (mx != mx) k = mx;
    for (int r = 0; r < roots - 1; r++) k = sqrtf(k);
    k = (1.0f / sqrtf(k)) * levels;
    if (mx == 0.0f) k = 0.0f;
    float fl = mx * floor_coef;
    if (fl < 0x1p-126f) fl = 0x1p-126f;
    *mx_out = mx; *mul_out = mul; *k_out = k; *floor_out = fl;
}

static inline int enc_i8m(const float *restrict x, int8_t *restrict codes, float *restrict scale,
                          const consts_t *C) {
    float s = absmax(x, I8B);
    *scale = s;
    float mx, mul, k, fl;
    scale_setup(s, 127.0f, C->i8m_floor, 1, &mx, &mul, &k, &fl);
    for (int i = 0; i < I8B; i++) {
        float a = fabsf(x[i]) * mul;
        float r = sqrtf(a > fl ? a : fl) * k;
        r = copysignf(rintf(r), x[i]);
        codes[i] = (int8_t)(int32_t)r;
    }
    return isfinite(s) ? 0 : BAD_NONFINITE;
}

static inline void fourth_values(const float *restrict x, int n, float levels, float mul, float k, float fl,
                                 float alpha, int32_t *restrict out);

static inline int enc_fourth(const float *restrict x, int n, float levels, float floor_coef,
                             float *restrict scale, int32_t *restrict out, const consts_t *C) {
    int neg = 0;
    for (int i = 0; i < n; i++) neg |= x[i] < 0.0f;
    float s = absmax(x, n);   /* (= the max: no negative value, or the encode fails) */
    *scale = s;
    float mx, mul, k, fl;
    scale_setup(s, levels, floor_coef, 2, &mx, &mul, &k, &fl);
    fourth_values(x, n, levels, mul, k, fl, C->dither_alpha, out);
    return (neg ? BAD_NEGATIVE : 0) | (isfinite(s) ? 0 : BAD_NONFINITE);
}

static inline void fourth_values(const float *restrict x, int n, float levels, float mul, float k, float fl,
                                 float alpha, int32_t *restrict out) {
    const float hi = levels + 0.5f;
    for (int i = 0; i < n; i++) {
        float a = x[i] * mul;
        float r = sqrtf(sqrtf(a > fl ? a : fl)) * k;
        float u = (float)((bits_of(x[i]) & 0xFFFF) + 65);
        r = fmaf(u, alpha, r);
        r = r < 1.0f ? 1.0f : r;
        r = r > hi ? hi : r;
        out[i] = (int32_t)r;
    }
}

static inline int enc_i8v(const float *restrict x, uint8_t *restrict codes, float *restrict scale,
                          const consts_t *C) {
    int32_t c[I8B];
    int bad = enc_fourth(x, I8B, 255.0f, C->i8v_floor, scale, c, C);
    for (int i = 0; i < I8B; i++) codes[i] = (uint8_t)c[i];
    return bad;
}

/* 32 nibbles (int32, 0..15) into 16 bytes: even index in the low nibble. */
static inline void pack_nibbles(const int32_t *restrict c, uint8_t *restrict codes) {
#if MT_AVX512
    for (int h = 0; h < 2; h++) {   /* 8 pairs as int64 lanes: lo + (hi << 32) */
        __m512i v = _mm512_loadu_si512((const void *)(c + 16 * h));
        __m512i r = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi64(15)),
                                    _mm512_and_si512(_mm512_srli_epi64(v, 28), _mm512_set1_epi64(0xF0)));
        _mm_storel_epi64((__m128i *)(codes + 8 * h), _mm512_cvtepi64_epi8(r));
    }
#elif MT_AVX2   /* the 32 codes as bytes in order, then each pair of bytes into one */
    __m256i a = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)c), _mm256_loadu_si256((const __m256i *)(c + 8)));
    __m256i b = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)(c + 16)),
                                   _mm256_loadu_si256((const __m256i *)(c + 24)));
    __m256i d = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    __m256i w = _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi16(0x0F)),
                                _mm256_and_si256(_mm256_srli_epi16(d, 4), _mm256_set1_epi16(0xF0)));
    _mm_storeu_si128((__m128i *)codes, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
#else
    for (int i = 0; i < I4B / 2; i++) codes[i] = (uint8_t)(c[2 * i] + 16 * c[2 * i + 1]);
#endif
}

static inline int enc_i4v(const float *restrict x, uint8_t *restrict codes, float *restrict scale,
                          const consts_t *C) {
    int32_t c[I4B];
    int bad = enc_fourth(x, I4B, 16.0f, C->i4v_floor, scale, c, C);
    for (int i = 0; i < I4B; i++) c[i] -= 1;
    pack_nibbles(c, codes);
    return bad;
}

static inline void i4m_values(const float *restrict x, float k, uint8_t *restrict codes);

static inline int enc_i4m(const float *restrict x, uint8_t *restrict codes, float *restrict scale,
                          const consts_t *C) {
    float s = absmax(x, I4B);
    *scale = s;
    float k = s < 0x1p-149f ? 0x1p-149f : s;
    if (s != s) k = s;
    k = 1.0f / sqrtf(k);
    i4m_values(x, k, codes);
    return isfinite(s) ? 0 : BAD_NONFINITE;
}

static inline void i4m_values(const float *restrict x, float k, uint8_t *restrict codes) {
    int32_t c[I4B];
    for (int i = 0; i < I4B; i++) {
        float y = (fabsf(x[i]) * k) * k;
        float q = copysignf(y, x[i]) * -7.5f;
        q = fmaf(y, 56.5f, q);
        q = q - 0.25f;
        q = q < 0.01f ? 0.01f : q;
        q = rintf(sqrtf(q));
        q = copysignf(q, x[i]) + 8.0f;
        c[i] = (int32_t)q;
    }
    pack_nibbles(c, codes);
}

/* G4 int4 blocks (nb of them stored; x holds all G4): the blocks' maxima first, then their
   scale constants (one vector of roots and divisions, no chain of them per block), then the
   values: each block's arithmetic is enc_i4m's / enc_i4v's. */
#define G4 (I8B / I4B)
static inline int enc_i4m_group(const float *restrict x, int nb, uint8_t *restrict codes, float *restrict scales) {
    float s[G4], kk[G4];
    int bad = 0;
    for (int b = 0; b < G4; b++) s[b] = absmax(x + I4B * b, I4B);
    for (int b = 0; b < G4; b++) {
        float k = s[b] < 0x1p-149f ? 0x1p-149f : s[b];
        if (s[b] != s[b]) k = s[b];
        kk[b] = 1.0f / sqrtf(k);
    }
    for (int b = 0; b < nb; b++) {
        scales[b] = s[b];
        bad |= isfinite(s[b]) ? 0 : BAD_NONFINITE;
        i4m_values(x + I4B * b, kk[b], codes + I4B / 2 * b);
    }
    return bad;
}

static inline int enc_i4v_group(const float *restrict x, int nb, uint8_t *restrict codes, float *restrict scales,
                                const consts_t *C) {
    float s[G4], mul[G4], kk[G4], fl[G4], mx;
    int neg = 0, bad = 0;
    for (int i = 0; i < nb * I4B; i++) neg |= x[i] < 0.0f;
    for (int b = 0; b < G4; b++) s[b] = absmax(x + I4B * b, I4B);
    for (int b = 0; b < G4; b++) scale_setup(s[b], 16.0f, C->i4v_floor, 2, &mx, mul + b, kk + b, fl + b);
    for (int b = 0; b < nb; b++) {
        int32_t c[I4B];
        scales[b] = s[b];
        bad |= isfinite(s[b]) ? 0 : BAD_NONFINITE;
        fourth_values(x + I4B * b, I4B, 16.0f, mul[b], kk[b], fl[b], C->dither_alpha, c);
        for (int i = 0; i < I4B; i++) c[i] -= 1;
        pack_nibbles(c, codes + I4B / 2 * b);
    }
    return bad | (neg ? BAD_NEGATIVE : 0);
}

/* ------------------------------------------------------------------ block decoders */
static inline void dec_i8m(const int8_t *restrict codes, float s, float *restrict out, const consts_t *C) {
    const float inv = C->inv127;
    for (int i = 0; i < I8B; i++) {
        float t = (float)codes[i] * inv;
        out[i] = (t * fabsf(t)) * s;
    }
}

static inline void floor_positive(float s, float *restrict out, int n, const consts_t *C) {
    if (s > 0.0f && s < C->tiny_scale)
        for (int i = 0; i < n; i++) out[i] = out[i] < 0x1p-149f ? 0x1p-149f : out[i];
}

static inline void dec_i8v(const uint8_t *restrict codes, float s, float *restrict out, const consts_t *C) {
    const float inv = C->inv255;
    for (int i = 0; i < I8B; i++) {
        float t = (float)codes[i] * inv;
        t = t * t;
        out[i] = (t * t) * s;
    }
    floor_positive(s, out, I8B, C);
}

static inline void dec_i4(const uint8_t *restrict codes, float s, float *restrict out, const float *lut) {
#if MT_AVX512   /* the 16 levels in one register: a lane permute per 16 values */
    __m512 L = _mm512_loadu_ps(lut), S = _mm512_set1_ps(s);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
    const __m512i i0 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i i1 = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_permutex2var_epi32(lo, i0, hi), L), S));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_permutex2var_epi32(lo, i1, hi), L), S));
#elif MT_AVX2   /* the 16 levels in two registers: two lane permutes and a blend per 8 values */
    const __m256 L0 = _mm256_loadu_ps(lut), L1 = _mm256_loadu_ps(lut + 8), S = _mm256_set1_ps(s);
    const __m128i b = _mm_loadu_si128((const __m128i *)codes), f = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), f);
    const __m128i ord[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};   /* the codes in order */
    for (int h = 0; h < 4; h++) {
        __m256i idx = _mm256_cvtepu8_epi32(h & 1 ? _mm_srli_si128(ord[h >> 1], 8) : ord[h >> 1]);
        __m256 val = _mm256_blendv_ps(_mm256_permutevar8x32_ps(L0, idx), _mm256_permutevar8x32_ps(L1, idx),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(val, S));
    }
#else
    for (int i = 0; i < I4B / 2; i++) {
        out[2 * i] = lut[codes[i] & 15] * s;
        out[2 * i + 1] = lut[codes[i] >> 4] * s;
    }
#endif
}

/* ------------------------------------------------------------------ AdamW */
/* torch._fused_adamw_'s arithmetic (ATen FusedAdamKernel.cpp): its vectorised lanes, and its
   scalar tail (the last numel % Vec::size() elements of each call) whose second moment is
   rounded differently: fma(v, beta2, (c2 * g) * g) instead of fma(c2 * g, g, v * beta2). */
/* a / b, correctly rounded, without a division: q = a * y with y = RN(1/b), then one Newton step
   on the exact residual (Markstein: RN(q + (a - q b) y) = RN(a / b) for y = RN(1/b) and a/b in the
   normal range). Here a = sqrt(v): 0, or in [2**-75, 2**64], so it holds; an infinite a (a
   diverged v) is passed through as the division would. The divider is the kernels' bottleneck:
   this leaves AdamW one division and one root per element, as DeepSpeed's, with torch's result. */
static inline float div_bc2s(float a, float b, float y) {
    float q = a * y;
    float r = fmaf(-q, b, a);
    q = fmaf(r, y, q);
    return a == INFINITY ? a : q;
}

static inline int32_t clamp_rel(int64_t x, int64_t base, int64_t n) {
    x -= base;
    return (int32_t)(x < 0 ? 0 : x > n ? n : x);
}

/* torch's vector lanes on n elements, all decayed (p * pmul) or none: a loop without selects. */
static inline void adam_lanes(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                              int32_t n, const int decayed, float pmul, float coef, float b2, float c2, float bc2s,
                              float rb, float eps, float negss) {
    for (int32_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = decayed ? p[i] * pmul : p[i];
        float mi = fmaf(coef, gi - m[i], m[i]);
        float cg = c2 * gi;
        float vi = fmaf(cg, gi, v[i] * b2);
        float den = div_bc2s(sqrtf(vi), bc2s, rb) + eps;
        p[i] = pi + (negss * mi) / den; m[i] = mi; v[i] = vi;
    }
}

/* n elements (n < 2**31) starting at absolute index base; the elements in A->tail take torch's
   scalar-tail rounding of the second moment (a select: both are computed). */
static inline void adam_span(float *restrict p, const float *restrict g, float *restrict m,
                             float *restrict v, int64_t n, int64_t base, const adam_t *A) {
    const float coef = A->coef, pmul = A->pmul, b2 = A->b2, c2 = A->c2, bc2s = A->bc2s, eps = A->eps,
                negss = A->negss, rb = 1.0f / bc2s;
    const int32_t dend = clamp_rel(A->decay_end, base, n), nn = (int32_t)n;
    const int32_t t0 = clamp_rel(A->tail[0], base, n), t1 = clamp_rel(A->tail[1], base, n);
    const int32_t t2 = clamp_rel(A->tail[2], base, n), t3 = clamp_rel(A->tail[3], base, n);
    const int from_grad = A->lerp_from_grad, tails = t1 > t0 || t3 > t2;
    if (!tails && !from_grad) {   /* the common case, on torch's vector lanes throughout */
        if (dend >= nn) adam_lanes(p, g, m, v, nn, 1, pmul, coef, b2, c2, bc2s, rb, eps, negss);
        else if (dend <= 0) adam_lanes(p, g, m, v, nn, 0, pmul, coef, b2, c2, bc2s, rb, eps, negss);
        else {
            adam_lanes(p, g, m, v, dend, 1, pmul, coef, b2, c2, bc2s, rb, eps, negss);
            adam_lanes(p + dend, g + dend, m + dend, v + dend, nn - dend, 0, pmul, coef, b2, c2, bc2s, rb, eps,
                       negss);
        }
        return;
    }
    for (int32_t i = 0; i < nn; i++) {
        float gi = g[i];
        float pi = p[i] * (i < dend ? pmul : 1.0f);
        float mi = fmaf(coef, gi - m[i], from_grad ? gi : m[i]);
        float cg = c2 * gi;
        int scalar = (i >= t0 && i < t1) || (i >= t2 && i < t3);
        float vi = scalar ? fmaf(v[i], b2, cg * gi) : fmaf(cg, gi, v[i] * b2);
        float den = div_bc2s(sqrtf(vi), bc2s, rb) + eps;
        p[i] = pi + (negss * mi) / den; m[i] = mi; v[i] = vi;
    }
}
/* n elements at absolute index base, each stepped by the one of the nA scalar sets (sorted by lo,
   disjoint) whose [lo, hi) holds it: a group's learning rate (EngineConfig.lr_scale) may change
   inside a codec block. (m, v may be a block's decoded moments: indexed from base too.) */
static inline void adam_groups(float *p, const float *g, float *m, float *v, int64_t n, int64_t base,
                               const adam_t *A, int nA) {
    for (int s = 0; s < nA; s++) {
        int64_t lo = A[s].lo > base ? A[s].lo : base, hi = A[s].hi < base + n ? A[s].hi : base + n;
        if (hi > lo) adam_span(p + (lo - base), g + (lo - base), m + (lo - base), v + (lo - base), hi - lo, lo, &A[s]);
    }
}

/* Plain AdamW over flat fp32 buffers (fp32 states): torch._fused_adamw_ bit for bit. */
static void adamw_range(float *p, const float *g, float *m, float *v, int64_t n, int64_t base, const adam_t *A,
                        int nA) {
    const int64_t step = 4096;
    for (int64_t i = 0; i < n; i += step) {
        int64_t k = n - i < step ? n - i : step;
        adam_groups(p + i, g + i, m + i, v + i, k, base + i, A, nA);
    }
}

/* ------------------------------------------------------------------ whole tensors */
/* kind: 0 int8 exp_avg, 1 int8 exp_avg_sq, 2 int4 exp_avg, 3 int4 exp_avg_sq.
   n elements of x; codes and scales cover ceil(n / block) blocks (the last one zero-padded). */
int mt_encode(int kind, const float *x, int64_t n, uint8_t *codes, float *scales, const consts_t *C) {
    int B = kind < 2 ? I8B : I4B, cpb = kind < 2 ? 1 : 2, bad = 0;
    int64_t nb = (n + B - 1) / B;
    float pad[I8B];
    for (int64_t j = 0; j < nb; j++) {
        const float *xb = x + j * B;
        if ((j + 1) * B > n) {
            memset(pad, 0, sizeof pad);
            memcpy(pad, xb, (size_t)(n - j * B) * 4);
            xb = pad;
        }
        uint8_t *cb = codes + j * B / cpb;
        switch (kind) {
        case 0: bad |= enc_i8m(xb, (int8_t *)cb, scales + j, C); break;
        case 1: bad |= enc_i8v(xb, cb, scales + j, C); break;
        case 2: bad |= enc_i4m(xb, cb, scales + j, C); break;
        default: bad |= enc_i4v(xb, cb, scales + j, C); break;
        }
    }
    return bad;
}

void mt_decode(int kind, const uint8_t *codes, const float *scales, int64_t n, float *out, const consts_t *C) {
    int B = kind < 2 ? I8B : I4B, cpb = kind < 2 ? 1 : 2;
    int64_t nb = (n + B - 1) / B;
    float pad[I8B];
    for (int64_t j = 0; j < nb; j++) {
        int full = (j + 1) * B <= n;
        float *ob = full ? out + j * B : pad;
        const uint8_t *cb = codes + j * B / cpb;
        switch (kind) {
        case 0: dec_i8m((const int8_t *)cb, scales[j], ob, C); break;
        case 1: dec_i8v(cb, scales[j], ob, C); break;
        case 2: dec_i4(cb, scales[j], ob, C->lut4m); break;
        default: dec_i4(cb, scales[j], ob, C->lut4v); floor_positive(scales[j], ob, I4B, C); break;
        }
        if (!full) memcpy(out + j * B, pad, (size_t)(n - j * B) * 4);
    }
}

/* ------------------------------------------------------------------ the fused step, 8 lanes */
#if MT_V8
/* update_range's common step (256 elements in one learning-rate group, on torch's vector lanes,
   all decayed or none, moments stored) in two passes instead of five: (A) the codes decoded
   straight into AdamW's lanes, the new moments and their block maxima (and second moment's sign
   bits); (B) AdamW's root and division on the weights, each block encoded from its known maximum
   in the same loop (step8). The arithmetic of every value is the one of dec_*, adam_lanes and
   enc_*, op for op: the same floats and codes. */
typedef struct { __m256 coef, pmul, b2, c2, bc2s, rb, eps, negss; } lanes_t;

static inline lanes_t lanes_of(const adam_t *A) {
    lanes_t L = {_mm256_set1_ps(A->coef), _mm256_set1_ps(A->pmul), _mm256_set1_ps(A->b2), _mm256_set1_ps(A->c2),
                 _mm256_set1_ps(A->bc2s), _mm256_set1_ps(1.0f / A->bc2s), _mm256_set1_ps(A->eps), _mm256_set1_ps(A->negss)};
    return L;
}

static inline __m256i abs_bits(__m256 x) { return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)); }

static inline float hmax_bits(__m256i x) {   /* the largest lane as a float's bits (absmax's) */
    __m128i y = _mm_max_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    y = _mm_max_epi32(y, _mm_shuffle_epi32(y, 0x4E));
    y = _mm_max_epi32(y, _mm_shuffle_epi32(y, 0xB1));
    return _mm_cvtss_f32(_mm_castsi128_ps(y));
}

/* 8 vectors' maxima as one vector (lane j: vector j's largest lane) */
static inline __m256i max8(const __m256i *x) {
    __m256i q[4], h[2];
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_max_epi32(_mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]), _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        h[i] = _mm256_max_epi32(_mm256_unpacklo_epi64(q[2 * i], q[2 * i + 1]), _mm256_unpackhi_epi64(q[2 * i], q[2 * i + 1]));
    return _mm256_max_epi32(_mm256_permute2x128_si256(h[0], h[1], 0x20), _mm256_permute2x128_si256(h[0], h[1], 0x31));
}

/* enc_i8m's codes of 8 values of a finite block (M: its mul, scaled: mul != 1) as int32 */
static inline __m256i i8m_vec(__m256 x, __m256 M, __m256 K, __m256 FL, const int scaled) {
    __m256 a = _mm256_castsi256_ps(abs_bits(x));
    if (scaled) a = _mm256_mul_ps(a, M);
    __m256 r = _mm256_mul_ps(_mm256_sqrt_ps(_mm256_max_ps(a, FL)), K);
    /* rintf is the conversion's rounding (both the current mode); copysignf: the code's sign (x = +-0:
       the code is 0, r being about 0.25 there) */
    return _mm256_sign_epi32(_mm256_cvtps_epi32(r), _mm256_castps_si256(x));
}

/* fourth_values' codes of 8 values of a finite block as int32, before its clamps (done on the bytes:
   (int)max(r, 1) = max((int)r, 1), r >= 0). Unscaled (mul 1), the first root is AdamW's: sqrtf is
   monotone, so sqrtf(max(x, fl)) = max(sqrtf(x), sqrtf(fl)), with sqrtf(x) the root AdamW took of
   the new moment (at w) and FL = sqrtf(fl); scaled, FL = fl. */
static inline __m256i fourth_of_root(__m256 x, __m256 s, __m256 K, __m256 A) {   /* s: the first root, floored */
    __m256i ub = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0xFFFF));
    __m256 u = _mm256_cvtepi32_ps(_mm256_add_epi32(ub, _mm256_set1_epi32(65)));
    return _mm256_cvttps_epi32(_mm256_fmadd_ps(u, A, _mm256_mul_ps(_mm256_sqrt_ps(s), K)));
}

static inline __m256i fourth_vec(__m256 x, const float *w, __m256 M, __m256 K, __m256 FL, __m256 A, const int scaled) {
    return fourth_of_root(x, scaled ? _mm256_sqrt_ps(_mm256_max_ps(_mm256_mul_ps(x, M), FL))
                                    : _mm256_max_ps(_mm256_load_ps(w), FL), K, A);
}

/* i4m_values' codes of 8 values of a finite block as int32, less 8: copysignf(y, x) is (x * k) * k
   (rounding is symmetric), y its magnitude */
static inline __m256i i4m_vec(__m256 x, __m256 K) {
    __m256 sy = _mm256_mul_ps(_mm256_mul_ps(x, K), K), y = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), sy);
    __m256 q = _mm256_fmadd_ps(y, _mm256_set1_ps(56.5f), _mm256_mul_ps(sy, _mm256_set1_ps(-7.5f)));
    q = _mm256_sub_ps(q, _mm256_set1_ps(0.25f));
    __m256i c = _mm256_cvtps_epi32(_mm256_sqrt_ps(_mm256_max_ps(q, _mm256_set1_ps(0.01f))));
    return _mm256_sign_epi32(c, _mm256_castps_si256(x));
}

/* 32 int32 codes as 32 bytes in order: signed (saturating at -128, 127) or unsigned (0, 255) */
static inline __m256i bytes32(__m256i a, __m256i b, __m256i c, __m256i d, const int sign) {
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i w = sign ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 bytes 0..15 (in order) as 16 bytes of nibbles: even index in the low nibble */
static inline void store_nibbles(__m256i d, uint8_t *codes) {
    __m256i w = _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi16(0x0F)),
                                _mm256_and_si256(_mm256_srli_epi16(d, 4), _mm256_set1_epi16(0xF0)));
    _mm_storeu_si128((__m128i *)codes, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

static inline void i8m_block(const float *x, float mul, float k, float fl, int8_t *codes, const int scaled) {
    const __m256 M = _mm256_set1_ps(mul), K = _mm256_set1_ps(k), FL = _mm256_set1_ps(fl);
    for (int i = 0; i < I8B; i += 32) {
        __m256i c[4];
        for (int h = 0; h < 4; h++) c[h] = i8m_vec(_mm256_load_ps(x + i + 8 * h), M, K, FL, scaled);
        _mm256_storeu_si256((__m256i *)(codes + i), bytes32(c[0], c[1], c[2], c[3], 1));
    }
}

static inline void i8v_block(const float *x, const float *w, float mul, float k, float fl, float alpha, uint8_t *codes,
                             const int scaled) {
    const __m256 M = _mm256_set1_ps(mul), K = _mm256_set1_ps(k), FL = _mm256_set1_ps(scaled ? fl : sqrtf(fl)),
                 A = _mm256_set1_ps(alpha);
    for (int i = 0; i < I8B; i += 32) {   /* (levels 255: the unsigned pack's saturation is the clamp) */
        __m256i c[4];
        for (int h = 0; h < 4; h++) c[h] = fourth_vec(_mm256_load_ps(x + i + 8 * h), w + i + 8 * h, M, K, FL, A, scaled);
        _mm256_storeu_si256((__m256i *)(codes + i), _mm256_max_epu8(bytes32(c[0], c[1], c[2], c[3], 0), _mm256_set1_epi8(1)));
    }
}

/* (fl: sqrtf of the floor, unscaled: fourth_vec) */
static inline void i4v_block(const float *x, const float *w, float mul, float k, float fl, float alpha, uint8_t *codes,
                             const int scaled) {
    const __m256 M = _mm256_set1_ps(mul), K = _mm256_set1_ps(k), FL = _mm256_set1_ps(fl), A = _mm256_set1_ps(alpha);
    __m256i c[4];
    for (int h = 0; h < 4; h++) c[h] = fourth_vec(_mm256_load_ps(x + 8 * h), w + 8 * h, M, K, FL, A, scaled);
    __m256i b = _mm256_subs_epu8(bytes32(c[0], c[1], c[2], c[3], 0), _mm256_set1_epi8(1));   /* max(c, 1) - 1 */
    store_nibbles(_mm256_min_epu8(b, _mm256_set1_epi8(15)), codes);
}

static inline void i4m_block(const float *x, float k, uint8_t *codes) {
    const __m256 K = _mm256_set1_ps(k);
    __m256i c[4];
    for (int h = 0; h < 4; h++) c[h] = i4m_vec(_mm256_load_ps(x + 8 * h), K);
    store_nibbles(_mm256_add_epi8(bytes32(c[0], c[1], c[2], c[3], 1), _mm256_set1_epi8(8)), codes);
}

/* the scalar set stepping all of [lo, hi) on torch's vector lanes, and whether it decays them all
   (else none); NULL: none does (a group's edge, torch's scalar tail, a lerp from the gradient, the
   decay's end inside, a bias correction above 1: weights_vec's max): the step takes the general path */
static inline const adam_t *lanes_group(const adam_t *A, int nA, int64_t lo, int64_t hi, int *decayed) {
    for (int s = 0; s < nA; s++) {
        if (A[s].lo > lo || A[s].hi < hi) continue;
        const adam_t *a = A + s;
        for (int t = 0; t < 4; t += 2)
            if ((a->tail[t] > lo ? a->tail[t] : lo) < (a->tail[t + 1] < hi ? a->tail[t + 1] : hi)) return NULL;
        if (a->lerp_from_grad || (a->decay_end > lo && a->decay_end < hi) || !(a->bc2s <= 1.0f)) return NULL;
        *decayed = a->decay_end >= hi;
        return a;
    }
    return NULL;
}

/* enc_i8m / enc_i8v of a block whose maximum s (absmax's) is known; neg: whether a value may be < 0 */
static inline int enc8_known(const float *m, const float *v, const float *w, float s_m, float s_v, int neg, int8_t *om,
                             float *osm, uint8_t *ov, float *osv, const consts_t *C) {
    int bad = 0;
    float mx, mul, k, fl;
    if (isfinite(s_m)) {
        *osm = s_m;
        scale_setup(s_m, 127.0f, C->i8m_floor, 1, &mx, &mul, &k, &fl);
        if (mul == 1.0f) i8m_block(m, mul, k, fl, om, 0);
        else i8m_block(m, mul, k, fl, om, 1);
    } else bad |= enc_i8m(m, om, osm, C);
    if (isfinite(s_v) && !neg) {
        *osv = s_v;
        scale_setup(s_v, 255.0f, C->i8v_floor, 2, &mx, &mul, &k, &fl);
        if (mul == 1.0f) i8v_block(v, w, mul, k, fl, C->dither_alpha, ov, 0);
        else i8v_block(v, w, mul, k, fl, C->dither_alpha, ov, 1);
    } else bad |= enc_i8v(v, ov, osv, C) << 2;
    return bad;
}

/* The common step in two passes over L1 arrays. Pass A (multiplies, conversions, permutes; no
   root): the codes decoded, the new moments into m, v, their blocks' maxima. Pass B (the divider:
   three roots and a division per 8 values): AdamW's root and the weights' step (weights_vec), and,
   where the blocks are on the common case (finite, no sign bit in the second moment, mul 1), both
   moments' codes in the same loop (the second moment's first root being AdamW's); else the root
   into w and the block encoders after. int8 runs a step's pass A inside the previous step's pass B,
   8 values of each at a time (ab8: the multiplies of one among the divider's work of the other);
   int4 does not (its pass A's permutes beside pass B measured 4-10% slower). Before, one loop did
   the decode, the moments and the weights' root and division (a dependent chain of ~70 cycles per
   8 values: more of it in flight than Zen 3's scheduler holds), then the encoders ran their roots
   alone. Each value's arithmetic is the same either way. */
static inline __m256 weights_vec(float *p, __m256 mi, __m256 vi, const lanes_t *L, const int decayed) {
    __m256 pi = _mm256_loadu_ps(p);
    if (decayed) pi = _mm256_mul_ps(pi, L->pmul);
    __m256 a = _mm256_sqrt_ps(vi), q = _mm256_mul_ps(a, L->rb);
    q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, L->bc2s, a), L->rb, q);
    /* div_bc2s's select of an infinite root as a max: a finite root's quotient is >= the root (bc2s <= 1),
       an infinite root's is NaN (the max takes the root); a NaN root's quotient is that NaN */
    q = _mm256_max_ps(q, a);
    __m256 den = _mm256_add_ps(q, L->eps);
    _mm256_storeu_ps(p, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(L->negss, mi), den)));
    return a;
}

/* fourth_vec, unscaled, of x whose sqrtf is a */
static inline __m256i fourth_root_vec(__m256 x, __m256 a, __m256 K, __m256 FL, __m256 A) {
    return fourth_of_root(x, _mm256_max_ps(a, FL), K, A);
}

/* An int8 step whose pass A is done, waiting for its pass B: update_range runs a step's pass A in the
   same loop as the previous step's pass B (step8), and the last one's alone (b8_flush) */
typedef struct {
    int live, common, decayed;
    const adam_t *a;
    float *p; uint8_t *om, *ov; float *osm, *osv;
    float sm, sv, km, flm, kv, flv;   /* int8: the block's maxima and, common, its encoders' constants */
    int neg;   /* a sign bit in the second moment */
    float m[I8B] __attribute__((aligned(32))), v[I8B] __attribute__((aligned(32)));
} pend_t;

/* pass A of int8 values [i0, i0 + n) of a step into m, v, their maxima into mxm, mxv, orv */
static inline __attribute__((always_inline)) void a8_vals(const int8_t *cm, const uint8_t *cv, const float *g,
        __m256 SM, __m256 SV, const lanes_t *L, const consts_t *C, float *m, float *v, __m256i *mxm,
        __m256i *mxv, __m256i *orv, int i0, const int n) {
    const __m256 i127 = _mm256_set1_ps(C->inv127), i255 = _mm256_set1_ps(C->inv255), sgn = _mm256_set1_ps(-0.0f);
    for (int i = i0; i < i0 + n; i += 8) {
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(cm + i)))), i127);
        __m256 mm = _mm256_mul_ps(_mm256_mul_ps(t, _mm256_andnot_ps(sgn, t)), SM);
        __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cv + i)))), i255);
        u = _mm256_mul_ps(u, u);
        __m256 vv = _mm256_mul_ps(_mm256_mul_ps(u, u), SV), gi = _mm256_loadu_ps(g + i);
        __m256 mo = _mm256_fmadd_ps(L->coef, _mm256_sub_ps(gi, mm), mm);
        __m256 vo = _mm256_fmadd_ps(_mm256_mul_ps(L->c2, gi), gi, _mm256_mul_ps(vv, L->b2));
        _mm256_store_ps(m + i, mo);
        _mm256_store_ps(v + i, vo);
        __m256i vb = _mm256_castps_si256(vo);
        *mxm = _mm256_max_epi32(*mxm, abs_bits(mo));
        *mxv = _mm256_max_epi32(*mxv, vb);   /* (no sign bit, or the general encoders) */
        *orv = _mm256_or_si256(*orv, vb);
    }
}

/* pass B of a pending int8 step off the common case: the weights, then enc8_known */
static int b8_general(pend_t *P, const consts_t *C) {
    float w[I8B] __attribute__((aligned(32)));
    const lanes_t L = lanes_of(P->a);
    for (int i = 0; i < I8B; i += 8) {
        const __m256 mi = _mm256_load_ps(P->m + i), vi = _mm256_load_ps(P->v + i);
        _mm256_store_ps(w + i, P->decayed ? weights_vec(P->p + i, mi, vi, &L, 1) : weights_vec(P->p + i, mi, vi, &L, 0));
    }
    return enc8_known(P->m, P->v, w, P->sm, P->sv, P->neg, (int8_t *)P->om, P->osm, P->ov, P->osv, C);
}

/* pass B of a pending common int8 step (AdamW's root and division, both codes), each 8 values beside
   8 of the next step's pass A into nx (with_a; the multiplies of one among the divider's work of the
   other: one vector of each at a time, so neither waits behind the other in the scheduler) */
static inline __attribute__((always_inline)) void ab8(pend_t *P, const int decayed, const int with_a, pend_t *nx,
        const int8_t *cm, const uint8_t *cv, const float *g, __m256 SM, __m256 SV, const lanes_t *LA,
        const consts_t *C, __m256i *mxm, __m256i *mxv, __m256i *orv) {
    const lanes_t L = lanes_of(P->a);
    const __m256 KM = _mm256_set1_ps(P->km), FLM = _mm256_set1_ps(P->flm), KV = _mm256_set1_ps(P->kv),
                 FLV = _mm256_set1_ps(sqrtf(P->flv)), AL = _mm256_set1_ps(C->dither_alpha);
    *P->osm = P->sm; *P->osv = P->sv;
    for (int i = 0; i < I8B; i += 32) {
        __m256i c[4], d[4];
        for (int h = 0; h < 4; h++) {
            if (with_a) a8_vals(cm, cv, g, SM, SV, LA, C, nx->m, nx->v, mxm, mxv, orv, i + 8 * h, 8);
            const __m256 mi = _mm256_load_ps(P->m + i + 8 * h), vi = _mm256_load_ps(P->v + i + 8 * h);
            const __m256 a = weights_vec(P->p + i + 8 * h, mi, vi, &L, decayed);
            c[h] = i8m_vec(mi, KM, KM, FLM, 0);
            d[h] = fourth_root_vec(vi, a, KV, FLV, AL);
        }
        _mm256_storeu_si256((__m256i *)(P->om + i), bytes32(c[0], c[1], c[2], c[3], 1));
        _mm256_storeu_si256((__m256i *)(P->ov + i), _mm256_max_epu8(bytes32(d[0], d[1], d[2], d[3], 0), _mm256_set1_epi8(1)));
    }
}

/* pass B of the pending int8 step, alone (the range's end, or a step on the general path next) */
static int b8_flush(pend_t *P, const consts_t *C) {
    if (!P->live) return 0;
    P->live = 0;
    if (!P->common) return b8_general(P, C);
    const __m256 z = _mm256_setzero_ps();
    if (P->decayed) ab8(P, 1, 0, NULL, NULL, NULL, NULL, z, z, NULL, C, NULL, NULL, NULL);
    else ab8(P, 0, 0, NULL, NULL, NULL, NULL, z, z, NULL, C, NULL, NULL, NULL);
    return 0;
}

/* the common int8 step at p: its pass A (with the pending step's pass B where that is common; else
   that one's pass B first), then it becomes the pending step (P[0] and P[1] swap: *cur) */
static int step8(pend_t *P, int *cur, float *p, const float *g, const int8_t *cm, float sm, const uint8_t *cv,
                 float sv, int8_t *om, float *osm, uint8_t *ov, float *osv, const adam_t *A, const int decayed,
                 const consts_t *C) {
    pend_t *pd = P + *cur, *nx = P + (1 - *cur);
    const lanes_t LA = lanes_of(A);
    const __m256 SM = _mm256_set1_ps(sm), SV = _mm256_set1_ps(sv);
    __m256i mxm = _mm256_setzero_si256(), mxv = mxm, orv = mxm;
    int bad = 0;
    if (pd->live && pd->common) {
        pd->live = 0;
        if (pd->decayed) ab8(pd, 1, 1, nx, cm, cv, g, SM, SV, &LA, C, &mxm, &mxv, &orv);
        else ab8(pd, 0, 1, nx, cm, cv, g, SM, SV, &LA, C, &mxm, &mxv, &orv);
    } else {
        bad = b8_flush(pd, C);
        a8_vals(cm, cv, g, SM, SV, &LA, C, nx->m, nx->v, &mxm, &mxv, &orv, 0, I8B);
    }
    nx->sm = hmax_bits(mxm); nx->sv = hmax_bits(mxv);
    nx->neg = _mm256_movemask_ps(_mm256_castsi256_ps(orv)) != 0;
    float mx, mulm = 0.0f, mulv = 0.0f;
    nx->km = nx->flm = nx->kv = nx->flv = 0.0f;
    if (isfinite(nx->sm)) scale_setup(nx->sm, 127.0f, C->i8m_floor, 1, &mx, &mulm, &nx->km, &nx->flm);
    if (isfinite(nx->sv) && !nx->neg) scale_setup(nx->sv, 255.0f, C->i8v_floor, 2, &mx, &mulv, &nx->kv, &nx->flv);
    nx->common = mulm == 1.0f && mulv == 1.0f;
    nx->live = 1; nx->decayed = decayed; nx->a = A;
    nx->p = p; nx->om = (uint8_t *)om; nx->ov = ov; nx->osm = osm; nx->osv = osv;
    *cur = 1 - *cur;
    return bad;
}

/* 32 int4 codes (16 bytes) decoded, times S: dec_i4's values with byte shuffles instead of its lane
   permutes (vpermps, slow on Zen 3 and beside the divider; this measured int4 +2-5%). T[j] holds
   byte j of each of the 16 levels (in both 128-bit lanes); the codes are laid out so that the
   in-lane unpacks of the four looked-up byte planes give the values in order: the same floats. */
static inline void nibbles_shuf(const uint8_t *codes, const __m256i *T, __m256 S, __m256 *out) {
    const __m128i b = _mm_loadu_si128((const __m128i *)codes), f = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), f);
    const __m128 o0 = _mm_castsi128_ps(_mm_unpacklo_epi8(lo, hi)), o1 = _mm_castsi128_ps(_mm_unpackhi_epi8(lo, hi));
    /* lane 0: values 0-3, 8-11, 16-19, 24-27; lane 1: 4-7, 12-15, 20-23, 28-31 */
    const __m256i y = _mm256_set_m128i(_mm_castps_si128(_mm_shuffle_ps(o0, o1, _MM_SHUFFLE(3, 1, 3, 1))),
                                       _mm_castps_si128(_mm_shuffle_ps(o0, o1, _MM_SHUFFLE(2, 0, 2, 0))));
    const __m256i b0 = _mm256_shuffle_epi8(T[0], y), b1 = _mm256_shuffle_epi8(T[1], y);
    const __m256i b2 = _mm256_shuffle_epi8(T[2], y), b3 = _mm256_shuffle_epi8(T[3], y);
    const __m256i l01 = _mm256_unpacklo_epi8(b0, b1), h01 = _mm256_unpackhi_epi8(b0, b1);
    const __m256i l23 = _mm256_unpacklo_epi8(b2, b3), h23 = _mm256_unpackhi_epi8(b2, b3);
    out[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(l01, l23)), S);
    out[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(l01, l23)), S);
    out[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(h01, h23)), S);
    out[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(h01, h23)), S);
}

/* the byte planes of 16 levels (nibbles_shuf's T) */
static inline void level_planes(const float *lut, __m256i *T) {
    uint8_t pl[4][16], by[64];
    memcpy(by, lut, 64);
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 16; k++) pl[j][k] = by[4 * k + j];
    for (int j = 0; j < 4; j++) T[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)pl[j]));
}

/* the scale constants of 8 int4 blocks, of their maxima sm (the first moment: enc_i4m_group's k)
   and sv (the second: scale_setup's mul, k, floor), as one vector each: the arithmetic of theirs */
static inline void scales4(__m256 sm, __m256 sv, const consts_t *C, float *km, float *mv, float *kv, float *fv) {
    const __m256 tiny = _mm256_set1_ps(0x1p-149f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    __m256 k = _mm256_blendv_ps(sm, tiny, _mm256_cmp_ps(sm, tiny, _CMP_LT_OQ));   /* (NaN: NaN) */
    _mm256_storeu_ps(km, _mm256_div_ps(one, _mm256_sqrt_ps(k)));
    __m256 small = _mm256_and_ps(_mm256_cmp_ps(sv, _mm256_set1_ps(0x1p-60f), _CMP_LT_OQ), _mm256_cmp_ps(sv, zero, _CMP_GT_OQ));
    __m256 mul = _mm256_blendv_ps(one, _mm256_set1_ps(0x1p64f), small);
    __m256 mx = _mm256_blendv_ps(sv, _mm256_mul_ps(sv, mul), small);
    k = _mm256_sqrt_ps(_mm256_blendv_ps(mx, tiny, _mm256_cmp_ps(mx, tiny, _CMP_LT_OQ)));
    k = _mm256_mul_ps(_mm256_div_ps(one, _mm256_sqrt_ps(k)), _mm256_set1_ps(16.0f));
    k = _mm256_blendv_ps(k, zero, _mm256_cmp_ps(mx, zero, _CMP_EQ_OQ));
    __m256 fl = _mm256_mul_ps(mx, _mm256_set1_ps(C->i4v_floor));
    fl = _mm256_blendv_ps(fl, _mm256_set1_ps(0x1p-126f), _mm256_cmp_ps(fl, _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ));
    _mm256_storeu_ps(mv, mul); _mm256_storeu_ps(kv, k); _mm256_storeu_ps(fv, fl);
}

static inline __attribute__((always_inline)) int step4(float *p, const float *g, const uint8_t *cm, const float *sm, const uint8_t *cv, const float *sv,
                 uint8_t *om, float *osm, uint8_t *ov, float *osv, const adam_t *A, const int decayed, const consts_t *C,
                 const __m256i *TM, const __m256i *TV) {
    float m[I8B] __attribute__((aligned(32))), v[I8B] __attribute__((aligned(32))), w[I8B] __attribute__((aligned(32)));
    __m256i mxm[G4], mxv[G4], orv = _mm256_setzero_si256();   /* (in memory: the blocks' maxima, 8 lanes each) */
    const lanes_t L = lanes_of(A);
    {
        for (int b = 0; b < G4; b++) {
            __m256 dm[4], dv[4];
            nibbles_shuf(cm + 16 * b, TM, _mm256_set1_ps(sm[b]), dm);
            nibbles_shuf(cv + 16 * b, TV, _mm256_set1_ps(sv[b]), dv);
            __m256i a = _mm256_setzero_si256(), c = a;
            for (int h = 0; h < 4; h++) {
                int i = I4B * b + 8 * h;
                __m256 gi = _mm256_loadu_ps(g + i);
                __m256 mo = _mm256_fmadd_ps(L.coef, _mm256_sub_ps(gi, dm[h]), dm[h]);
                __m256 vo = _mm256_fmadd_ps(_mm256_mul_ps(L.c2, gi), gi, _mm256_mul_ps(dv[h], L.b2));
                _mm256_store_ps(m + i, mo);
                _mm256_store_ps(v + i, vo);
                __m256i vb = _mm256_castps_si256(vo);
                a = _mm256_max_epi32(a, abs_bits(mo));
                c = _mm256_max_epi32(c, vb);
                orv = _mm256_or_si256(orv, vb);
            }
            _mm256_store_si256(mxm + b, a); _mm256_store_si256(mxv + b, c);
        }
    }
    float s_m[G4], s_v[G4], km[G4], mv[G4], kv[G4], fv[G4], sfv[G4], mx, mul, k, fl;
    const __m256 SMX = _mm256_castsi256_ps(max8(mxm)), SVX = _mm256_castsi256_ps(max8(mxv));
    _mm256_storeu_ps(s_m, SMX);
    _mm256_storeu_ps(s_v, SVX);
    scales4(SMX, SVX, C, km, mv, kv, fv);
    _mm256_storeu_ps(sfv, _mm256_sqrt_ps(_mm256_loadu_ps(fv)));
    int common = !_mm256_movemask_ps(_mm256_castsi256_ps(orv));
    for (int b = 0; b < G4; b++) common &= isfinite(s_m[b]) && isfinite(s_v[b]) && mv[b] == 1.0f;
    if (common) {   /* pass B with both encoders (step8's) */
        const __m256 AL = _mm256_set1_ps(C->dither_alpha);
        for (int b = 0; b < G4; b++) {
            const __m256 KM = _mm256_set1_ps(km[b]), KV = _mm256_set1_ps(kv[b]), FLV = _mm256_set1_ps(sfv[b]);
            __m256i c[4], d[4];
            for (int h = 0; h < 4; h++) {
                const int i = I4B * b + 8 * h;
                const __m256 mi = _mm256_load_ps(m + i), vi = _mm256_load_ps(v + i);
                const __m256 a = weights_vec(p + i, mi, vi, &L, decayed);
                c[h] = i4m_vec(mi, KM);
                d[h] = fourth_root_vec(vi, a, KV, FLV, AL);
            }
            store_nibbles(_mm256_add_epi8(bytes32(c[0], c[1], c[2], c[3], 1), _mm256_set1_epi8(8)), om + 16 * b);
            store_nibbles(_mm256_min_epu8(_mm256_subs_epu8(bytes32(d[0], d[1], d[2], d[3], 0), _mm256_set1_epi8(1)),
                                          _mm256_set1_epi8(15)), ov + 16 * b);
            osm[b] = s_m[b]; osv[b] = s_v[b];
        }
        return 0;
    }
    for (int i = 0; i < I8B; i += 8)
        _mm256_store_ps(w + i, weights_vec(p + i, _mm256_load_ps(m + i), _mm256_load_ps(v + i), &L, decayed));
    int bad = 0;
    if (_mm256_movemask_ps(_mm256_castsi256_ps(orv))) {   /* a sign bit: enc_i4v_group's own checks */
        bad |= enc_i4m_group(m, G4, om, osm);
        return bad | enc_i4v_group(v, G4, ov, osv, C) << 2;
    }
    for (int b = 0; b < G4; b++) {
        osm[b] = s_m[b];
        if (isfinite(s_m[b])) i4m_block(m + I4B * b, km[b], om + 16 * b);
        else { bad |= BAD_NONFINITE; i4m_values(m + I4B * b, km[b], om + 16 * b); }
        osv[b] = s_v[b];
        if (isfinite(s_v[b])) {
            if (mv[b] == 1.0f) i4v_block(v + I4B * b, w + I4B * b, mv[b], kv[b], sfv[b], C->dither_alpha, ov + 16 * b, 0);
            else i4v_block(v + I4B * b, w + I4B * b, mv[b], kv[b], fv[b], C->dither_alpha, ov + 16 * b, 1);
        } else {
            int32_t c[I4B];
            bad |= BAD_NONFINITE << 2;
            scale_setup(s_v[b], 16.0f, C->i4v_floor, 2, &mx, &mul, &k, &fl);
            fourth_values(v + I4B * b, I4B, 16.0f, mul, k, fl, C->dither_alpha, c);
            for (int i = 0; i < I4B; i++) c[i] -= 1;
            pack_nibbles(c, ov + 16 * b);
        }
    }
    return bad;
}
#endif

#if MT_V8
/* whether none of n scales of the second moment has dec_i8v's / dec_i4's floor (floor_positive) */
static inline int no_floor(const float *s, int n, const consts_t *C) {
    for (int i = 0; i < n; i++)
        if (s[i] > 0.0f && s[i] < C->tiny_scale) return 0;
    return 1;
}
#endif

/* ------------------------------------------------------------------ the fused update */
/* One pass over n elements (absolute index base; base a multiple of the block): each block's
   moments decoded from (cm, sm, cv, sv) -- zeros when cm is NULL --, AdamW on p with g, and the
   new moments encoded into (om, osm, ov, osv). in and out may be the same codes. Returns the
   first moment's encode flags | the second moment's << 2. */
static int update_range(int codec, float *p, const float *g,
              const uint8_t *cm, const float *sm, const uint8_t *cv, const float *sv,
              uint8_t *om, float *osm, uint8_t *ov, float *osv,
              int64_t n, int64_t base, const adam_t *A, int nA, const consts_t *C) {
    /* a step of S elements: one int8 block, or G4 int4 blocks (AdamW on 256 values at a time) */
    const int B = codec == 8 ? I8B : I4B, S = I8B;
    int bad = 0;
    float m[I8B], v[I8B];
#if MT_V8
    pend_t P[2];
    int cur = 0;
    P[0].live = P[1].live = 0;
    __m256i TM[4], TV[4];   /* int4: the levels' byte planes */
    if (codec == 4) { level_planes(C->lut4m, TM); level_planes(C->lut4v, TV); }
#endif
    for (int64_t off = 0; off < n; off += S) {
        const int k = n - off < S ? (int)(n - off) : S, nb = (k + B - 1) / B;
        const int64_t j0 = off / B;
#if MT_V8
        int decayed;
        const adam_t *a = k == S && cm != NULL ? lanes_group(A, nA, base + off, base + off + S, &decayed) : NULL;
        if (a != NULL && no_floor(sv + j0, nb, C)) {
            if (codec == 8)
                bad |= step8(P, &cur, p + off, g + off, (const int8_t *)cm + off, sm[j0], cv + off, sv[j0],
                             (int8_t *)om + off, osm + j0, ov + off, osv + j0, a, decayed, C);
            else
                bad |= decayed ? step4(p + off, g + off, cm + off / 2, sm + j0, cv + off / 2, sv + j0,
                                       om + off / 2, osm + j0, ov + off / 2, osv + j0, a, 1, C, TM, TV)
                               : step4(p + off, g + off, cm + off / 2, sm + j0, cv + off / 2, sv + j0,
                                       om + off / 2, osm + j0, ov + off / 2, osv + j0, a, 0, C, TM, TV);
            continue;
        }
        if (codec == 8) bad |= b8_flush(P + cur, C);
#endif
        if (cm == NULL) {
            memset(m, 0, sizeof m); memset(v, 0, sizeof v);
        } else if (codec == 8) {
            dec_i8m((const int8_t *)cm + off, sm[j0], m, C);
            dec_i8v(cv + off, sv[j0], v, C);
        } else {
            for (int b = 0; b < nb; b++) {
                dec_i4(cm + off / 2 + 16 * b, sm[j0 + b], m + I4B * b, C->lut4m);
                dec_i4(cv + off / 2 + 16 * b, sv[j0 + b], v + I4B * b, C->lut4v);
                floor_positive(sv[j0 + b], v + I4B * b, I4B, C);
            }
        }
        adam_groups(p + off, g + off, m, v, k, base + off, A, nA);
        if (k < S) {   /* the last block's zero padding (and, for int4, the step's blocks past it) */
            memset(m + k, 0, (size_t)(S - k) * 4); memset(v + k, 0, (size_t)(S - k) * 4);
        }
        if (codec == 8) {
            bad |= enc_i8m(m, (int8_t *)om + off, osm + j0, C);
            bad |= enc_i8v(v, ov + off, osv + j0, C) << 2;
        } else {
            bad |= enc_i4m_group(m, nb, om + off / 2, osm + j0);
            bad |= enc_i4v_group(v, nb, ov + off / 2, osv + j0, C) << 2;
        }
    }
#if MT_V8
    if (codec == 8) bad |= b8_flush(P + cur, C);
#endif
    return bad;
}

/* ------------------------------------------------------------------ threads */
/* The entry points split their range over `threads` threads (the caller's and threads - 1
   pthreads started for the call), in whole blocks; a range under MIN_SPLIT elements is not
   split. No element's result depends on the split. */
#define MIN_SPLIT (1 << 18)
#define MAX_THREADS 256

typedef struct {
    int codec; float *p; const float *g; float *m, *v;
    const uint8_t *cm; const float *sm; const uint8_t *cv; const float *sv;
    uint8_t *om; float *osm; uint8_t *ov; float *osv;
    int64_t n, base; const adam_t *A; int nA; const consts_t *C; int bad;
} job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    if (j->codec == 0) adamw_range(j->p, j->g, j->m, j->v, j->n, j->base, j->A, j->nA);
    else j->bad = update_range(j->codec, j->p, j->g, j->cm, j->sm, j->cv, j->sv, j->om, j->osm, j->ov, j->osv,
                               j->n, j->base, j->A, j->nA, j->C);
    return NULL;
}

static int run_split(job_t *whole, int threads, int64_t block, int per_byte) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || whole->n < MIN_SPLIT) { run_job(whole); return whole->bad; }
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int64_t per = (whole->n / threads + block - 1) / block * block, off = 0;
    int t = 0;
    for (; t < threads && off < whole->n; t++, off += per) {
        job_t *j = &jobs[t];
        int64_t cb = off / per_byte, sb = off / block;   /* its codes' and scales' offsets */
        *j = *whole;
        j->p = whole->p + off; j->g = whole->g + off; j->base = whole->base + off; j->bad = 0;
        j->n = whole->n - off < per ? whole->n - off : per;
        if (whole->codec == 0) { j->m = whole->m + off; j->v = whole->v + off; continue; }
        if (whole->cm) { j->cm = whole->cm + cb; j->sm = whole->sm + sb; j->cv = whole->cv + cb; j->sv = whole->sv + sb; }
        j->om = whole->om + cb; j->osm = whole->osm + sb; j->ov = whole->ov + cb; j->osv = whole->osv + sb;
    }
    for (int i = 1; i < t; i++) started[i] = pthread_create(&tid[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    int bad = jobs[0].bad;
    for (int i = 1; i < t; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else run_job(&jobs[i]);   /* (no thread could be started: run it here) */
        bad |= jobs[i].bad;
    }
    return bad;
}

void mt_adamw(float *p, const float *g, float *m, float *v, int64_t n, int64_t base, const adam_t *A, int nA,
              int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.p = p; j.g = g; j.m = m; j.v = v; j.n = n; j.base = base; j.A = A; j.nA = nA;
    run_split(&j, threads, 64, 1);
}

/* The fused update of n elements (absolute index base, a multiple of the block): update_range. */
int mt_update(int codec, float *p, const float *g,
              const uint8_t *cm, const float *sm, const uint8_t *cv, const float *sv,
              uint8_t *om, float *osm, uint8_t *ov, float *osv,
              int64_t n, int64_t base, const adam_t *A, int nA, const consts_t *C, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.codec = codec; j.p = p; j.g = g; j.cm = cm; j.sm = sm; j.cv = cv; j.sv = sv;
    j.om = om; j.osm = osm; j.ov = ov; j.osv = osv; j.n = n; j.base = base; j.A = A; j.nA = nA; j.C = C;
    return run_split(&j, threads, codec == 8 ? I8B : I4B, codec == 8 ? 1 : 2);
}
"""

#: Flags of every build; ``-march=native`` is added when the compiler takes it (the cache key
#: holds the CPU's flags). No -ffast-math: it would flush subnormals to zero and reassociate.
#: ``-fno-trapping-math`` (no FP exception traps assumed; the arithmetic and its roundings unchanged)
#: lets gcc if-convert AdamW's select of an infinite root and vectorise its loop: without it gcc 12
#: left that loop scalar (0.17 G params/s a thread on an AVX2 EPYC, 1.0-1.4 with it).
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math")
NATIVE = ("-march=native",)
ENV = "MEGATRAIN_NB_FUSED_UPDATE"

_KIND = {("int8", "exp_avg"): 0, ("int8", "exp_avg_sq"): 1, ("int4", "exp_avg"): 2, ("int4", "exp_avg_sq"): 3}
_CODEC = {"int8": 8, "int4": 4}
_BAD_NEGATIVE, _BAD_NONFINITE = 1, 2


class _Consts(ctypes.Structure):
    _fields_ = [(n, ctypes.c_float) for n in ("i8m_floor", "i8v_floor", "i4v_floor", "dither_alpha", "inv127",
                                               "inv255", "tiny_scale")] \
        + [("lut4m", ctypes.c_float * 16), ("lut4v", ctypes.c_float * 16)]


class AdamArgs(ctypes.Structure):
    """torch._fused_adamw_'s scalars as its kernel rounds them (:func:`adam_args`)."""
    _fields_ = [(n, ctypes.c_float) for n in ("coef", "pmul", "b2", "c2", "bc2s", "eps", "negss")] \
        + [("lerp_from_grad", ctypes.c_int32), ("decay_end", ctypes.c_int64), ("tail", ctypes.c_int64 * 4),
           ("lo", ctypes.c_int64), ("hi", ctypes.c_int64)]


#: ``AdamArgs.hi`` of scalars that step every element from ``lo`` on.
ALL = 1 << 62
_I64x4 = ctypes.c_int64 * 4


def _f32(x: float) -> float:
    """``x`` rounded to float as torch rounds it (a C cast, to nearest); ~60x faster than a tensor."""
    return ctypes.c_float(x).value


def adam_args(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
              decay_end: int, regions, width: int, lo: int = 0, hi: int = ALL) -> AdamArgs:
    """The AdamW scalars of one update as ``torch._fused_adamw_`` computes and rounds them (in
    double, then to float), for the elements of ``regions``: the ``[lo, hi)`` spans (absolute
    indices) on which the torch path calls the fused kernel once each -- their last ``(hi - lo) %
    width`` elements take torch's scalar tail. Elements below ``decay_end`` are decayed. ``lo``,
    ``hi``: the absolute elements these scalars step (a learning-rate group; the kernels take one
    set per group, :func:`group_args`)."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    lerp = _f32(1 - beta1)
    small = abs(lerp) < 0.5
    tails = [(lo + (hi - lo) // width * width, hi) for lo, hi in regions if hi > lo][:2]
    tails += [(0, 0)] * (2 - len(tails))
    # (a c_float field rounds what it is given to float as _f32 does: a C cast, to nearest)
    return AdamArgs(lerp if small else lerp - 1.0, 1 - lr * weight_decay if weight_decay != 0 else 1.0,
                    beta2, 1 - beta2, math.sqrt(bc2), eps, -(lr / bc1),
                    0 if small else 1, int(decay_end), _I64x4(*[i for t in tails for i in t]),
                    int(lo), int(hi))


def group_args(args):
    """``(array, count)`` for the kernels: one AdamArgs, or several (sorted by ``lo``, disjoint)."""
    if isinstance(args, AdamArgs):
        return ctypes.byref(args), 1
    if isinstance(args, ctypes.Array):   # packed once for many calls (CodedChunk.step's pieces)
        return args, len(args)
    arr = (AdamArgs * len(args))(*args)
    return arr, len(args)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def encode_error(flags: int, codec: str, role: str) -> Optional[ValueError]:
    """The torch path's error for a kernel's encode flags of one moment (None: encoded)."""
    if flags & _BAD_NEGATIVE:
        return ValueError("exp_avg_sq must be non-negative")
    if flags & _BAD_NONFINITE:
        return ValueError(f"cannot encode {role} with the {codec} codec: it contains NaN or Inf (the optimizer "
                          f"state has diverged)")
    return None


class Kernels:
    """The loaded kernels (:func:`kernels`). Tensors are 1-D, contiguous, on the CPU; codes
    and scales are laid out as ``codecs.py`` stores them."""

    def __init__(self, lib: ctypes.CDLL, path: str, compiler: str = ""):
        self.lib, self.path, self.compiler = lib, path, compiler
        #: torch's fused AdamW vector width here (its scalar tail: numel % width), found by check()
        self.width = 0
        from .codecs import Int4MomentCodec, Int4VarianceCodec, dither_alpha   # circle: codecs import these kernels at their top

        lut = lambda cls: (ctypes.c_float * 16)(*cls.LEVELS.tolist())  # noqa: E731
        self.consts = _Consts(_f32((0.25 / 127.0) ** 2), _f32((0.5 / 255.0) ** 4), _f32((0.5 / 16.0) ** 4),
                              _f32(dither_alpha()), _f32(1.0 / 127.0), _f32(1.0 / 255.0), _f32(1e-30),
                              lut(Int4MomentCodec), lut(Int4VarianceCodec))
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.mt_encode.argtypes = [ctypes.c_int, vp, i64, vp, vp, vp]
        lib.mt_decode.argtypes = [ctypes.c_int, vp, vp, i64, vp, vp]
        lib.mt_decode.restype = None
        lib.mt_update.argtypes = [ctypes.c_int] + [vp] * 10 + [i64, i64, vp, ctypes.c_int, vp, ctypes.c_int]
        lib.mt_adamw.argtypes = [vp] * 4 + [i64, i64, vp, ctypes.c_int, ctypes.c_int]
        lib.mt_adamw.restype = None
        self._c = ctypes.byref(self.consts)

    def encode(self, codec: str, role: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> int:
        """Encode ``x`` into ``codes``/``scales`` (the last block zero-padded); returns flags
        (:func:`encode_error`)."""
        return self.lib.mt_encode(_KIND[codec, role], _ptr(x), x.numel(), _ptr(codes), _ptr(scales), self._c)

    def decode(self, codec: str, role: str, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        self.lib.mt_decode(_KIND[codec, role], _ptr(codes), _ptr(scales), out.numel(), _ptr(out), self._c)

    def update(self, codec: str, params: torch.Tensor, grads: torch.Tensor, src: Optional[Dict[str, torch.Tensor]],
               dst: Dict[str, torch.Tensor], base: int, args, threads: int = 1, at: int = 0) -> None:
        """One chunk's update (``base``: its first element's index in the unit, a block
        boundary): ``src`` (codes and scales of both moments, or None: zeros) decoded, AdamW on
        ``params`` in place (``args``: one AdamArgs, or one per learning-rate group: :func:`group_args`),
        encoded into ``dst`` (may be ``src``), on ``threads`` threads (the result does not depend
        on it). ``at``: the element of ``src``'s and ``dst``'s codes that ``params[0]`` is (a block
        boundary; a piece of a chunk: no views made for it). Raises the torch path's error for a
        moment that cannot be encoded."""
        self.update_call(codec, params, grads, src, dst, base, args, threads, at)(0, params.numel())

    def update_call(self, codec: str, params: torch.Tensor, grads: torch.Tensor, src, dst, base: int, args,
                    threads: int = 1, at: int = 0):
        """:meth:`update` as ``call(s, e)``: the update of elements ``[s, e)`` of the chunk (``s`` a
        block boundary), its pointers and scalars made once."""
        arr, count = group_args(args)
        c = self.lib.mt_update
        kind, block, per_byte, consts = _CODEC[codec], 256 if codec == "int8" else 32, 1 if codec == "int8" else 2, self._c
        roles = ("exp_avg.codes", "exp_avg.scales", "exp_avg_sq.codes", "exp_avg_sq.scales")
        offs = (at // per_byte, at // block * 4) * 2   # (codes, scales) of each moment
        ins = [0, 0, 0, 0] if src is None else [src[r].data_ptr() + o for r, o in zip(roles, offs)]
        outs = [dst[r].data_ptr() + o for r, o in zip(roles, offs)]
        p, g, base = params.data_ptr(), grads.data_ptr(), int(base)

        def call(s: int, e: int) -> None:
            cb, sb = s // per_byte, s // block * 4
            i = (None, None, None, None) if src is None else (ins[0] + cb, ins[1] + sb, ins[2] + cb, ins[3] + sb)
            flags = c(kind, p + 4 * s, g + 4 * s, *i, outs[0] + cb, outs[1] + sb, outs[2] + cb, outs[3] + sb,
                      e - s, base + s, arr, count, consts, threads)
            if flags:
                for role, bits in (("exp_avg", flags & 3), ("exp_avg_sq", flags >> 2)):
                    err = encode_error(bits, codec, role)
                    if err is not None:
                        raise err
        return call

    def adamw(self, params, grads, exp_avg, exp_avg_sq, base: int, args, threads: int = 1) -> None:
        """AdamW over flat fp32 buffers in place (``base``: the absolute index of their first
        element; ``args`` one AdamArgs or one per group), on ``threads`` threads:
        ``torch._fused_adamw_`` bit for bit."""
        arr, count = group_args(args)
        self.lib.mt_adamw(_ptr(params), _ptr(grads), _ptr(exp_avg), _ptr(exp_avg_sq), params.numel(), int(base),
                          arr, count, int(threads))

    # ------------------------------------------------------------------ the self-check
    def check(self) -> None:
        """Raise RuntimeError unless this build computes what torch does here: AdamW equal
        (and torch's vector width found), decode equal, codes equal or one level apart."""
        self.width = self._probe_width()
        from .codecs import get_codec   # circle: codecs import these kernels at their top

        g = torch.Generator().manual_seed(0)
        n = 8192 + 77
        rows = torch.pow(10.0, -9 + 6 * torch.rand(n // 32 + 1, 1, generator=g)).expand(-1, 32).reshape(-1)[:n]
        m = torch.randn(n, generator=g) * rows
        v = torch.randn(n, generator=g).square() * rows.square()
        m[::11], v[::13] = 0.0, 0.0
        for codec in _CODEC:
            for role, x in (("exp_avg", m), ("exp_avg_sq", v)):
                c = get_codec(codec, role)
                want = c.encode_torch(x)
                got = {k: torch.empty_like(t) for k, t in want.items()}
                if self.encode(codec, role, x, got["codes"], got["scales"]) or not torch.equal(got["scales"],
                                                                                                 want["scales"]):
                    raise RuntimeError(f"{codec} {role}: its scales differ from torch's")
                if not _near_codes(c, got["codes"], want["codes"]):
                    raise RuntimeError(f"{codec} {role}: its codes differ from torch's by more than one level")
                a, b = torch.empty(n), torch.empty(n)
                self.decode(codec, role, want["codes"], want["scales"], a)
                if not torch.equal(a, c.decode_torch(want, b)):
                    raise RuntimeError(f"{codec} {role}: its decoded values differ from torch's")

    def _probe_width(self) -> int:
        """torch's fused AdamW on 127 values whose second moment rounds differently on its
        vector lanes and in its scalar tail: the trailing ones on the scalar path are
        ``127 % width`` = width - 1. Also checks every value against this kernel's."""
        g = torch.Generator().manual_seed(1)
        n = 4096
        p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
        m, v = torch.randn(n, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-6
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3.0, decay_end=n)

        def ours(tails, idx=None):
            t = [x.clone() if idx is None else x[idx].clone() for x in (p, gr, m, v)]
            k = t[0].numel()
            self.adamw(t[0], t[1], t[2], t[3], 0, adam_args(**{**kw, "decay_end": k}, regions=tails(k), width=1 << 30))
            return t
        vec, sca = ours(lambda k: []), ours(lambda k: [(0, k)])
        idx = (vec[3] != sca[3]).nonzero().squeeze(1)[:127]
        if idx.numel() < 127:
            raise RuntimeError("cannot find values to probe torch's AdamW with")
        vec, sca = ours(lambda k: [], idx), ours(lambda k: [(0, k)], idx)
        ref = [x[idx].clone() for x in (p, gr, m, v)]
        torch._fused_adamw_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(3.0)], lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        on_vec = [all(bool(torch.equal(r[i], a[i])) for r, a in zip(ref, vec)) for i in range(127)]
        on_sca = [all(bool(torch.equal(r[i], a[i])) for r, a in zip(ref, sca)) for i in range(127)]
        tail = 127 - next((i for i in range(127) if not on_vec[i]), 127)
        if tail + 1 not in (2, 4, 8, 16, 32, 64) or not all(on_vec[:127 - tail]) or not all(on_sca[127 - tail:]):
            raise RuntimeError("its AdamW differs from torch._fused_adamw_")
        return tail + 1


def _near_codes(codec, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Codes equal, or (a root rounded one ulp apart) one level apart, in at most 1 in 1000."""
    if codec.codes_per_byte == 2:
        got = torch.stack([got & 15, got >> 4], 1).view(-1)
        want = torch.stack([want & 15, want >> 4], 1).view(-1)
    d = (got.to(torch.int32) - want.to(torch.int32)).abs()
    return int(d.max()) <= 1 and int((d > 0).sum()) * 1000 <= d.numel()


# ---------------------------------------------------------------------------------- loading
_LOCK = threading.Lock()
_STATE: dict = {"tried": False, "kernels": None, "why": None, "off": 0}


def kernels() -> Optional[Kernels]:
    """The kernels, built or loaded on the first call (thread-safe); None where they are not
    available (:func:`disabled_reason` says why, and the first call logged it)."""
    if _STATE["off"]:
        return None
    if not _STATE["tried"]:
        with _LOCK:
            if not _STATE["tried"]:
                _STATE["kernels"] = _load()
                _STATE["tried"] = True
    return _STATE["kernels"]


def disabled_reason() -> Optional[str]:
    """Why :func:`kernels` is None (None: it is not, or it was not called yet)."""
    return "turned off (torch_path())" if _STATE["off"] else _STATE["why"]


class torch_path:
    """``with torch_path():`` the codecs and the update run on torch ops (tests, benchmarks)."""

    def __enter__(self):
        with _LOCK:
            _STATE["off"] += 1
        return self

    def __exit__(self, *exc):
        with _LOCK:
            _STATE["off"] -= 1


def _load() -> Optional[Kernels]:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _STATE["why"] = f"{ENV}=0"
        log.info("fused update kernels off (%s=0): the optimizer-state codecs run on torch ops", ENV)
        return None
    t0 = time.perf_counter()
    try:
        path, built, cc = _build()
        k = Kernels(ctypes.CDLL(path), path, cc)
        k.check()
    except Exception as e:  # noqa: BLE001 - any failure leaves the torch path, said once
        _STATE["why"] = str(e)
        log.warning("fused update kernels unavailable (%s): the optimizer-state codecs and the compressed update "
                    "run on torch ops, several times slower", e)
        return None
    log.info("fused update kernels %s in %.1f s: %s (torch AdamW vector width %d)",
             "built" if built else "loaded", time.perf_counter() - t0, path, k.width)
    return k


def cache_dir() -> str:
    """Where built kernels are kept: ``$MEGATRAIN_NB_CACHE/kernels`` (else ``~/.cache/megatrain_nb/kernels``)."""
    root = os.environ.get("MEGATRAIN_NB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")
    return os.path.join(root, "kernels")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    sig = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features", "model name", "CPU part"):
                    sig.append(line.strip())
                if len(sig) >= 4:
                    break
    except OSError:
        sig.append(platform.processor())
    return "\n".join(sig)


def _trusted(path: str) -> None:
    """A cached library is loaded into the process: only one this user owns and nobody else
    can write (its folder included)."""
    for p in (path, os.path.dirname(path)):
        st = os.stat(p)
        if (hasattr(os, "geteuid") and st.st_uid != os.geteuid()) or st.st_mode & 0o022:
            raise RuntimeError(f"{p} is not this user's alone (owner {st.st_uid}, mode {st.st_mode & 0o777:o}): "
                               f"not loaded")


def _build():
    """(path of the shared library, whether it was built now, the compiler): from the cache, or compiled
    into it (a temporary file renamed into place: concurrent builds are harmless)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from e
    folder = cache_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    errors = []
    for flags in (FLAGS + NATIVE, FLAGS):
        key = hashlib.sha256("\0".join([SOURCE, " ".join(flags), version, _cpu_signature()]).encode()).hexdigest()[:20]
        path = os.path.join(folder, f"mt_update-{key}.so")
        if os.path.exists(path):
            _trusted(path)
            return path, False, cc
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = os.path.join(tmp, "mt_update.c"), os.path.join(tmp, "mt_update.so")
            with open(src, "w") as f:
                f.write(SOURCE)
            try:
                r = subprocess.run([cc, *flags, "-o", out, src, "-lm"], capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(str(e))
                continue
            if r.returncode == 0 and os.path.exists(out):
                os.replace(out, path)
                return path, True, cc
            errors.append((r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"])
    raise RuntimeError(f"{cc} could not build the kernels: {errors[-1]}")


# ---------------------------------------------------------------------------------- threads
class UpdateTeam:
    """The threads one update runs on (``EngineConfig.optimizer_threads``): the calling thread
    (``mtnb-adamw``) and ``threads - 1`` helpers (``mtnb-update``, started on first use). :meth:`run`
    cuts a flat range into contiguous pieces on ``align`` boundaries (a codec's block, torch's
    vector width) that the threads take in turn; every piece is stepped alone by elementwise
    kernels with absolute indices, so no result depends on the split (tests compare 1 and N)."""

    #: A range shorter than this is not split; a longer one is cut in pieces of at most PIECE
    #: elements (as many threads as free cores or not, none waits for a slower one's fixed share).
    MIN_SPLIT, PIECE = 1 << 12, 1 << 18

    def __init__(self, threads: int = 1):
        self.threads = max(int(threads), 1)
        self._pool = None
        self._lock = threading.Lock()

    def _helpers(self):
        with self._lock:
            if self._pool is None and self.threads > 1:
                self._pool = executor(UPDATE, self.threads - 1)
            return self._pool

    def run(self, n: int, align: int, fn, extra=(), piece: Optional[int] = None) -> None:
        """``fn(s, e)`` over ``[0, n)`` in pieces (``s`` on an ``align`` boundary), on this thread,
        the helpers and ``extra`` (single-thread executors that join the team: the codec threads,
        idle while a fused chunk runs); ``piece``: the most elements a piece has (None: PIECE);
        raises the first piece's error once every piece is done."""
        extra = tuple(p for p in extra if p is not None)
        helpers = max(self.threads - 1 - len(extra), 0)
        width = 1 + len(extra) + helpers
        if n < self.MIN_SPLIT or width == 1:
            fn(0, n)
            return
        per = -(-min(piece or self.PIECE, -(-n // width)) // align) * align
        pieces = iter([(s, min(s + per, n)) for s in range(0, n, per)])
        lock = threading.Lock()

        def take() -> None:
            while True:
                with lock:
                    span = next(pieces, None)
                if span is None:
                    return
                fn(*span)
        pool = self._helpers() if helpers else None
        futures = [p.submit(take) for p in extra] + [pool.submit(take) for _ in range(helpers)]
        try:
            take()
        finally:
            errors = [f.exception() for f in futures]   # (every piece done before this returns)
        for e in errors:
            if e is not None:
                raise e

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


#: One thread: what a caller without a team (measurements, tests) runs on.
SOLO = UpdateTeam(1)


# ---------------------------------------------------------------------------------- chunks
class CodedChunk:
    """Elements ``[a, b)`` of a unit's two moments as codes: what a fused chunked update
    (``OptimizerStates.update``) hands its ``apply`` in place of decoded fp32 moments. AdamW
    (``optimizer.UnitRun.step``) then runs the kernel on it (:meth:`step`): the codes in
    ``src`` (None: zeros, the first update) are decoded, stepped and encoded into ``dst``.
    ``pools``: single-thread executors (the codec threads) that join the update's team
    (:class:`UpdateTeam`) for the chunk; no result depends on the split."""

    __slots__ = ("kernels", "codecs", "src", "dst", "a", "b", "pools", "done", "codec", "block")

    def __init__(self, kern: Kernels, codecs: Dict[str, object], src, dst, a: int, b: int, pools=()):
        self.kernels, self.codecs, self.src, self.dst, self.a, self.b = kern, codecs, src, dst, a, b
        self.pools = tuple(p for p in pools if p is not None)
        self.done = False
        self.codec = next(iter(codecs.values())).name
        self.block = max(c.block for c in codecs.values())

    def step(self, params: torch.Tensor, grads: torch.Tensor, args, team: UpdateTeam = SOLO) -> None:
        """AdamW on the chunk: ``params`` and ``grads`` its ``b - a`` elements (contiguous);
        ``args`` one AdamArgs or one per learning-rate group (absolute indices); on ``team``'s
        threads and the codec threads."""
        if self.done:
            raise RuntimeError("a fused chunk is stepped once")
        self.done = True
        grads = grads.contiguous()
        if not isinstance(args, AdamArgs):   # packed once, not once a piece
            args = (AdamArgs * len(args))(*args)
        team.run(params.numel(), self.block, lambda s, e: self._part(params, grads, args, s, e), extra=self.pools)

    def _part(self, params, grads, args, s: int, e: int) -> None:
        if s == 0 and e == params.numel():   # the whole chunk (one thread)
            self.kernels.update(self.codec, params, grads, self.src, self.dst, self.a, args)
            return
        self.kernels.update(self.codec, params[s:e], grads[s:e], self.src, self.dst, self.a + s, args, at=s)


def chunk_views(codecs: Dict[str, object], codes: Optional[Dict[str, torch.Tensor]], a: int, b: int):
    """Views of the codes and scales of elements ``[a, b)`` (``a`` on a block boundary) of a
    unit's stored codes (None: None)."""
    if codes is None:
        return None
    out = {}
    for role, c in codecs.items():
        lo, hi = a // c.block, -(-b // c.block)
        out[f"{role}.codes"] = codes[f"{role}.codes"][lo * c.block // c.codes_per_byte:hi * c.block // c.codes_per_byte]
        out[f"{role}.scales"] = codes[f"{role}.scales"][lo:hi]
    return out
