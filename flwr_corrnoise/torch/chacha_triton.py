"""ChaCha20 keystream blocks in one fused Triton kernel: the CUDA path of
:func:`flwr_corrnoise.torch.device_noise.chacha20_blocks`.

Why a second way to compute the same words: the torch-ops keystream is ≈ 600 elementwise
launches a row (ten double rounds of quarter-rounds, rotations as shift-and-or, rows rolled
for the diagonals), each reading and writing the whole ``16 × blocks`` state. On a GPU that is
launch- and bandwidth-bound; here each thread keeps one block's sixteen 32-bit words in
registers through the twenty rounds (Bernstein, "ChaCha, a variant of Salsa20", 2008; RFC 8439
§ 2.3) and writes the block once. The words are integers, so both ways give the same words bit
for bit (``tests/noise/test_device_noise.py`` checks this kernel against the torch ops, and the
torch ops against OpenSSL, under Triton's interpreter on the CPU and on a CUDA device when one
is present). Imported only where Triton is (PyTorch's CUDA builds ship it)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

#: blocks a Triton program computes (one per thread of its warps)
BLOCK = 256


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))  # uint32: the shifts are logical


@triton.jit
def _quarter_round(a, b, c, d):
    """RFC 8439 § 2.1 on uint32 vectors (additions wrap)."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _word(ptr, i, zero):
    return zero + tl.load(ptr + i).to(tl.uint32, bitcast=True)


@triton.jit
def _store(o, i, x, s, mask):
    tl.store(o + i, (x + s).to(tl.int64), mask=mask)  # uint32 → int64 zero-extends


@triton.jit
def _chacha20_kernel(out_ptr, in_ptr, first, count, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < count
    z = tl.zeros([BLOCK], dtype=tl.uint32)
    i0, i1, i2, i3 = (_word(in_ptr, 0, z), _word(in_ptr, 1, z), _word(in_ptr, 2, z),
                      _word(in_ptr, 3, z))
    i4, i5, i6, i7 = (_word(in_ptr, 4, z), _word(in_ptr, 5, z), _word(in_ptr, 6, z),
                      _word(in_ptr, 7, z))
    i8, i9, i10, i11 = (_word(in_ptr, 8, z), _word(in_ptr, 9, z), _word(in_ptr, 10, z),
                        _word(in_ptr, 11, z))
    i12 = (first + idx).to(tl.uint32)  # the block counter (the caller keeps it < 2³²)
    i13, i14, i15 = _word(in_ptr, 13, z), _word(in_ptr, 14, z), _word(in_ptr, 15, z)
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, i12, i13, i14, i15
    for _ in tl.static_range(10):  # a double round: columns, then diagonals
        x0, x4, x8, x12 = _quarter_round(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter_round(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter_round(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter_round(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter_round(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter_round(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter_round(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter_round(x3, x4, x9, x14)
    o = out_ptr + idx.to(tl.int64) * 16
    _store(o, 0, x0, i0, mask)
    _store(o, 1, x1, i1, mask)
    _store(o, 2, x2, i2, mask)
    _store(o, 3, x3, i3, mask)
    _store(o, 4, x4, i4, mask)
    _store(o, 5, x5, i5, mask)
    _store(o, 6, x6, i6, mask)
    _store(o, 7, x7, i7, mask)
    _store(o, 8, x8, i8, mask)
    _store(o, 9, x9, i9, mask)
    _store(o, 10, x10, i10, mask)
    _store(o, 11, x11, i11, mask)
    _store(o, 12, x12, i12, mask)
    _store(o, 13, x13, i13, mask)
    _store(o, 14, x14, i14, mask)
    _store(o, 15, x15, i15, mask)


def chacha20_blocks(head: Sequence[int], nonce_words: Sequence[int], first: int, count: int,
                    device: torch.device) -> torch.Tensor:
    """``count × 16`` int64 words of blocks ``first …`` of the state whose first twelve words
    are ``head`` (constants and key) and last three ``nonce_words`` (checked by the caller)."""
    words = np.array([*head, 0, *nonce_words], dtype=np.uint32).view(np.int32)
    state = torch.from_numpy(words).to(device)
    out = torch.empty((count, 16), dtype=torch.int64, device=device)
    if count:
        # Triton launches on the *current* CUDA device, not the tensors': on a model on
        # cuda:1 with cuda:0 current, the kernel would address another device's memory
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _chacha20_kernel[(triton.cdiv(count, BLOCK),)](out, state, int(first),
                                                          int(count), BLOCK=BLOCK)
    return out
