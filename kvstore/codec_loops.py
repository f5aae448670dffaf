"""The codec's compiled loops (numba): `encode_groups`, `decode_groups`. Imported only through
kvstore/codec_fast.py, which says what they do and when they run.

For the groups quantized per token (2..8 bits, the codec's default mode), they
do everything between the block's float32 elements and its encoded bytes:
gather from the block's layout, the Walsh-Hadamard butterflies, row minimum and
maximum, the float16 scale and minimum, quantization, bit-plane packing (and
back, scattering bfloat16 elements into the block's layout). One group at a
time, transposed into a [channels, tokens] tile so that every step runs along
the tokens (contiguous: the compiler vectorizes it).

Two steps work on eight or four elements at once in a 64-bit word, where the
shapes allow (numba widens byte and 16-bit arithmetic to 64 bits, so a loop
over single bytes does not vectorize):
- the bit planes, with 8 | tokens: a word holds one plane byte of eight tokens
  (`_unpack_planes`, `_pack_planes`: one shift, mask and or per eight codes);
- the transpose between the tile and a block that keeps a token's channels
  contiguous (vLLM's GPU layouts, the CPU values), with 4 | tokens and
  channels: four channels by four tokens of 16 bits, four words, transposed
  in registers (`_transpose4`).

Byte-exact with the NumPy code: the same float32 operations in the same order
(no fast-math: no fused multiply-add where NumPy rounds twice), `rint` rounding
half to even, float16 conversions rounding to nearest even (done on the bits
here: numba has no float16 on the CPU), the same little-endian bit planes.
tests/test_codec_fast.py holds the two to the same bytes.
"""

from __future__ import annotations

import numba
import numpy as np


def jit(fn):
    """Compiled where first called, its machine code cached beside the module (or in numba's user cache)
    where that can be written; compiled anew in each process where nothing can be (a read-only install
    run by a user without a home): numba raises at decoration then."""
    try:
        return numba.njit(cache=True, nogil=True, error_model="numpy")(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, nogil=True, error_model="numpy")(fn)


@jit
def _f16_bits(src, dst, n):
    """dst[t] = the float16 bits of the float32 whose bits are src[t] (uint32), for t < n, rounding to
    nearest even as NumPy's astype(float16). Every case computed and one selected (no branch), so the
    loop runs a vector of values a step."""
    for t in range(n):
        u = np.int64(src[t])
        sign = (u >> 16) & 0x8000
        exp = (u >> 23) & 0xFF
        mant = u & 0x7FFFFF
        e = exp - 112  # rebias 127 -> 15
        r = (max(e, 0) << 10) | (mant >> 13)  # a normal float16
        rem = mant & 0x1FFF
        r += 1 if rem > 0x1000 or (rem == 0x1000 and r & 1) else 0  # (a carry into the exponent is right)
        shift = min(max(14 - e, 1), 62)  # a subnormal one: e in [-10, 0], shift 14..24
        m = mant | 0x800000
        rs = m >> shift
        rem_s = m & ((np.int64(1) << shift) - 1)
        half = np.int64(1) << (shift - 1)
        rs += 1 if rem_s > half or (rem_s == half and rs & 1) else 0
        r = r if e > 0 else (rs if e >= -10 else 0)
        r = 0x7C00 if e >= 31 else r  # too large: infinity
        r = (0x7E00 if mant else 0x7C00) if exp == 0xFF else r  # NaN, infinity
        dst[t] = sign | r


@jit
def _f16_values(h, out, out_bits, n):
    """out[t] = the float32 of the float16 bits h[t] (exact), for t < n; `out_bits`: out's uint32 view.
    Two passes of one case each, no branch: the bits of normal numbers, infinities and NaN, then the
    subnormal ones (and zeros) as values."""
    for t in range(n):
        x = h[t]
        exp = (x >> 10) & 0x1F
        mant = x & 0x3FF
        normal = ((x & 0x8000) << 16) | ((exp + 112) << 23) | (mant << 13)
        special = 0x7FC00000 if mant else ((x & 0x8000) << 16) | 0x7F800000
        out_bits[t] = np.uint32(special if exp == 31 else normal)
    for t in range(n):
        x = h[t]
        sign = np.float32(-1.0) if x & 0x8000 else np.float32(1.0)
        small = sign * np.float32(x & 0x3FF) * np.float32(2.0 ** -24)
        out[t] = small if (x >> 10) & 0x1F == 0 else out[t]


@jit
def _rotate(tile, scale):
    """The normalized Walsh-Hadamard transform of every column of tile [D, N], stage order as
    kvstore.codec.fwht: stage h pairs row i with i + h in runs of 2h, (a + b, a - b). Two stages a pass
    where it can (h and 2h on four rows: the same additions in the same order), the scaling folded into
    the last pass: the same float32 results, half the passes over the tile."""
    D, N = tile.shape
    h = 1
    while h < D:
        last = 4 * h >= D
        if 2 * h < D:  # stages h and 2h together
            for start in range(0, D, 4 * h):
                for i in range(start, start + h):
                    for t in range(N):
                        a, b, c, d = tile[i, t], tile[i + h, t], tile[i + 2 * h, t], tile[i + 3 * h, t]
                        s1, d1, s2, d2 = a + b, a - b, c + d, c - d
                        if last:
                            tile[i, t], tile[i + h, t] = (s1 + s2) * scale, (d1 + d2) * scale
                            tile[i + 2 * h, t], tile[i + 3 * h, t] = (s1 - s2) * scale, (d1 - d2) * scale
                        else:
                            tile[i, t], tile[i + h, t], tile[i + 2 * h, t], tile[i + 3 * h, t] = (
                                s1 + s2, d1 + d2, s1 - s2, d1 - d2)
            h *= 4
        else:  # one stage left (D an odd power of two), the last
            for start in range(0, D, 2 * h):
                for i in range(start, start + h):
                    for t in range(N):
                        a, b = tile[i, t], tile[i + h, t]
                        tile[i, t], tile[i + h, t] = (a + b) * scale, (a - b) * scale
            h *= 2
    if D == 1:
        for t in range(N):
            tile[0, t] = tile[0, t] * scale


@jit
def _plane_bytes(blob, p0, N, D, P):
    """A bit plane's bytes blob[p0 + t * D/8 + c8] into P[c8, t] (so the bits unpack along the tokens);
    eight at a time as one little-endian word where a token's bytes are whole words."""
    if D % 64 == 0:
        W = blob[p0 : p0 + N * D // 8].view(np.uint64)
        wpt = D // 64
        for c8 in range(D // 8):
            w, sh = c8 // 8, np.uint64(8 * (c8 % 8))
            for t in range(N):
                P[c8, t] = np.uint8((W[t * wpt + w] >> sh) & np.uint64(0xFF))
    else:
        for t in range(N):
            for c8 in range(D // 8):
                P[c8, t] = blob[p0 + t * (D // 8) + c8]

@jit
def _put_plane_bytes(P, out, p0, N, D):
    """The inverse of `_plane_bytes`: P[c8, t] to out[p0 + t * D/8 + c8]."""
    if D % 64 == 0:
        W = out[p0 : p0 + N * D // 8].view(np.uint64)
        wpt = D // 64
        for w in range(wpt):
            for t in range(N):
                word = np.uint64(0)
                for i in range(8):
                    word |= np.uint64(P[w * 8 + i, t]) << np.uint64(8 * i)
                W[t * wpt + w] = word
    else:
        for t in range(N):
            for c8 in range(D // 8):
                out[p0 + t * (D // 8) + c8] = P[c8, t]

_LOW_BITS = np.uint64(0x0101010101010101)  # bit 0 of each byte of a word
_HALVES16 = np.uint64(0x0000FFFF0000FFFF)
_HALVES32 = np.uint64(0x00000000FFFFFFFF)


@jit
def _unpack_planes(blob, start, plane, b, N, D, P, q):
    """q[c, t] (uint8 [D, N], zeroed here) = the b-bit codes of the planes at blob[start + j * plane]; P:
    a [D/8, N] uint8 scratch tile."""
    q[:] = 0
    if N % 8 == 0:  # a word of P: one plane byte of eight tokens; of q: eight tokens' codes of a channel
        P64, q64 = P.view(np.uint64), q.view(np.uint64)
        for j in range(b):
            _plane_bytes(blob, start + j * plane, N, D, P)  # P[c8, t]: bit i = bit j of q[8 c8 + i, t]
            sj = np.uint64(j)
            for c8 in range(D // 8):
                for i in range(8):
                    si = np.uint64(i)
                    for w in range(N // 8):
                        q64[c8 * 8 + i, w] |= ((P64[c8, w] >> si) & _LOW_BITS) << sj
        return
    for j in range(b):
        _plane_bytes(blob, start + j * plane, N, D, P)
        for c8 in range(D // 8):
            for i in range(8):
                c = c8 * 8 + i
                for t in range(N):
                    q[c, t] |= ((P[c8, t] >> i) & 1) << j


@jit
def _pack_planes(q, b, N, D, P, out, start, plane):
    """The inverse of `_unpack_planes`: the b bit planes of the codes q[c, t] to out[start + j * plane]."""
    for j in range(b):
        if N % 8 == 0:
            P64, q64 = P.view(np.uint64), q.view(np.uint64)
            sj = np.uint64(j)
            for c8 in range(D // 8):
                for w in range(N // 8):
                    word = np.uint64(0)
                    for i in range(8):
                        word |= ((q64[c8 * 8 + i, w] >> sj) & _LOW_BITS) << np.uint64(i)
                    P64[c8, w] = word
        else:
            P[:] = 0
            for c8 in range(D // 8):
                for i in range(8):
                    c = c8 * 8 + i
                    for t in range(N):
                        P[c8, t] |= ((q[c, t] >> j) & 1) << i
        _put_plane_bytes(P, out, start + j * plane, N, D)


@jit
def _transpose4(a0, a1, a2, a3):
    """Four words of four 16-bit lanes, transposed: lane i of word k becomes lane k of word i."""
    b0 = (a0 & _HALVES16) | ((a1 & _HALVES16) << np.uint64(16))
    b1 = ((a0 >> np.uint64(16)) & _HALVES16) | (a1 & ~_HALVES16)
    b2 = (a2 & _HALVES16) | ((a3 & _HALVES16) << np.uint64(16))
    b3 = ((a2 >> np.uint64(16)) & _HALVES16) | (a3 & ~_HALVES16)
    return ((b0 & _HALVES32) | (b2 << np.uint64(32)), (b1 & _HALVES32) | (b3 << np.uint64(32)),
            (b0 >> np.uint64(32)) | (b2 & ~_HALVES32), (b1 >> np.uint64(32)) | (b3 & ~_HALVES32))


@jit
def _by_words(rows, cols, N, D):
    """Whether `_transpose4` can move a group between its tile and the block: a token's channels
    contiguous, and every token's first element on a whole 64-bit word (16-bit elements)."""
    if N % 4 or D % 4:
        return False
    for c in range(D):
        if cols[c] != c:
            return False
    for t in range(N):
        if rows[t] % 4:
            return False
    return True


@jit
def _gather4(x16, rows, N, D, r16):
    """r16[c, t] = x16[rows[t] + c], four channels by four tokens a step (`_by_words` holds)."""
    x64, r64 = x16.view(np.uint64), r16.view(np.uint64)
    for tw in range(N // 4):
        t = 4 * tw
        for c in range(0, D, 4):
            r64[c, tw], r64[c + 1, tw], r64[c + 2, tw], r64[c + 3, tw] = _transpose4(
                x64[(rows[t] + c) >> 2], x64[(rows[t + 1] + c) >> 2], x64[(rows[t + 2] + c) >> 2],
                x64[(rows[t + 3] + c) >> 2])


@jit
def _scatter4(r16, rows, N, D, out16):
    """The inverse of `_gather4`: out16[rows[t] + c] = r16[c, t]."""
    o64, r64 = out16.view(np.uint64), r16.view(np.uint64)
    for tw in range(N // 4):
        t = 4 * tw
        for c in range(0, D, 4):
            w0, w1, w2, w3 = _transpose4(r64[c, tw], r64[c + 1, tw], r64[c + 2, tw], r64[c + 3, tw])
            o64[(rows[t] + c) >> 2] = w0
            o64[(rows[t + 1] + c) >> 2] = w1
            o64[(rows[t + 2] + c) >> 2] = w2
            o64[(rows[t + 3] + c) >> 2] = w3


@jit
def _offsets(base, ax, N, D, rows, cols):
    """Group axes ax (kvstore.codec.BlockLayout.axes) -> rows[t], cols[c]: token t, channel c of the group
    is element base + rows[t] + cols[c]. Returns whether its tokens are contiguous (rows[t] = base + t)."""
    tn, t_out, t_in, cn, c_out, c_in = ax[0], ax[1], ax[2], ax[3], ax[4], ax[5]
    for t in range(N):
        rows[t] = base + (t // tn) * t_out + (t % tn) * t_in
    for c in range(D):
        cols[c] = (c // cn) * c_out + (c % cn) * c_in
    return t_in == 1 and tn >= N

@jit
def encode_groups(x, x16, base, bits, offsets, axes, N, D, rotate, scale, out):
    """Encode the token-quantized groups: group k's elements sit at x[base[k] + (t // tn) * t_outer
    + (t % tn) * t_inner + (c // cn) * c_outer + (c % cn) * c_inner] (axes[k] = those six; x float32, the
    whole block; or, when x16 is not empty, the bfloat16 bits in x16), its bytes go to out[offsets[k]:]
    (meta: N float16 scales, N float16 minimums; then bits[k] planes of N * D / 8 bytes)."""
    tile = np.empty((D, N), np.float32)
    tile_u = tile.view(np.uint32)
    bf16 = x16.size > 0
    q = np.empty((D, N), np.uint8)
    lo = np.empty(N, np.float32)
    hi = np.empty(N, np.float32)
    low = np.empty(N, np.float32)
    inv = np.empty(N, np.float32)
    step = np.empty(N, np.float32)  # a row's scale: (hi - lo) / levels, then as its float16 reads back
    lo_u, low_u, step_u = lo.view(np.uint32), low.view(np.uint32), step.view(np.uint32)
    s16 = np.empty(N, np.int64)
    l16 = np.empty(N, np.int64)
    P = np.empty((D // 8, N), np.uint8)
    r16 = np.empty((D, N), np.uint16)
    rows = np.empty(N, np.int64)
    cols = np.empty(D, np.int64)
    plane = N * D // 8
    for k in range(base.size):
        if _offsets(base[k], axes[k], N, D, rows, cols):  # tokens contiguous (a transposed key): along them
            for c in range(D):
                o = rows[0] + cols[c]
                if bf16:
                    for t in range(N):
                        tile_u[c, t] = np.uint32(x16[o + t]) << 16
                else:
                    for t in range(N):
                        tile[c, t] = x[o + t]
        elif bf16 and _by_words(rows, cols, N, D):  # a token's channels contiguous: a transpose by words
            _gather4(x16, rows, N, D, r16)
            for c in range(D):
                for t in range(N):
                    tile_u[c, t] = np.uint32(r16[c, t]) << 16
        else:  # a transpose, element by element
            for t in range(N):
                row = rows[t]
                if bf16:
                    for c in range(D):
                        tile_u[c, t] = np.uint32(x16[row + cols[c]]) << 16
                else:
                    for c in range(D):
                        tile[c, t] = x[row + cols[c]]
        if rotate:
            _rotate(tile, scale)
        for t in range(N):
            lo[t] = tile[0, t]
            hi[t] = tile[0, t]
        for c in range(1, D):
            for t in range(N):
                v = tile[c, t]
                lo[t] = min(lo[t], v)
                hi[t] = max(hi[t], v)
        b = bits[k]
        levels = (1 << b) - 1
        off = offsets[k]
        for t in range(N):
            step[t] = (hi[t] - lo[t]) / np.float32(levels)
        _f16_bits(step_u, s16, N)
        _f16_bits(lo_u, l16, N)
        for t in range(N):
            out[off + 2 * t] = s16[t] & 0xFF
            out[off + 2 * t + 1] = s16[t] >> 8
            out[off + 2 * N + 2 * t] = l16[t] & 0xFF
            out[off + 2 * N + 2 * t + 1] = l16[t] >> 8
        _f16_values(s16, step, step_u, N)
        _f16_values(l16, low, low_u, N)
        for t in range(N):
            inv[t] = np.float32(1.0) / step[t] if step[t] > 0 else np.float32(0.0)
        fl = np.float32(levels)
        for c in range(D):
            for t in range(N):
                v = np.rint((tile[c, t] - low[t]) * inv[t])
                v = min(max(v, np.float32(0.0)), fl)
                q[c, t] = np.uint8(v)
        _pack_planes(q, b, N, D, P, out, off + 4 * N, plane)

@jit
def decode_groups(blob, offsets, bits, base, axes, N, D, rotate, scale, out16):
    """The inverse for bfloat16 blocks: group k's bytes at blob[offsets[k]:] become bfloat16 bits
    written to out16 (uint16) where `encode_groups` reads them."""
    tile = np.empty((D, N), np.float32)
    q = np.empty((D, N), np.uint8)
    sc = np.empty(N, np.float32)
    low = np.empty(N, np.float32)
    sc_u, low_u = sc.view(np.uint32), low.view(np.uint32)
    s16 = np.empty(N, np.int64)
    l16 = np.empty(N, np.int64)
    tile_u = tile.view(np.uint32)
    P = np.empty((D // 8, N), np.uint8)
    r16 = np.empty((D, N), np.uint16)
    rows = np.empty(N, np.int64)
    cols = np.empty(D, np.int64)
    plane = N * D // 8
    for k in range(base.size):
        off = offsets[k]
        b = bits[k]
        for t in range(N):
            s16[t] = np.int64(blob[off + 2 * t]) | (np.int64(blob[off + 2 * t + 1]) << 8)
            l16[t] = np.int64(blob[off + 2 * N + 2 * t]) | (np.int64(blob[off + 2 * N + 2 * t + 1]) << 8)
        _f16_values(s16, sc, sc_u, N)
        _f16_values(l16, low, low_u, N)
        _unpack_planes(blob, off + 4 * N, plane, b, N, D, P, q)
        for c in range(D):
            for t in range(N):
                y = np.float32(q[c, t]) * sc[t]
                tile[c, t] = y + low[t]
        if rotate:
            _rotate(tile, scale)
        for c in range(D):  # round to bfloat16 here, along the tokens (vectorized)...
            for t in range(N):
                u = tile_u[c, t]
                r16[c, t] = np.uint16((u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16))
        if _offsets(base[k], axes[k], N, D, rows, cols):  # ...then write: tokens contiguous (a transposed key)
            for c in range(D):
                o = rows[0] + cols[c]
                for t in range(N):
                    out16[o + t] = r16[c, t]
        elif _by_words(rows, cols, N, D):  # a token's channels contiguous: a transpose by words
            _scatter4(r16, rows, N, D, out16)
        else:  # a transpose, element by element
            for t in range(N):
                row = rows[t]
                for c in range(D):
                    out16[row + cols[c]] = r16[c, t]
