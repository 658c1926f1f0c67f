"""Matrix products of the forward pass: a repacked weight matrix (model/weights.py) times a chunk of activations.

The activations are rounded to 8-bit codes per 32-element block once per input (:class:`Activations`, filled by
``kernels.quantize_blocks``) and shared by every matrix that reads that input; each product then runs
``kernels.matmul_q`` (block-quantized weights) or ``kernels.matmul_dense`` (F32/F16/BF16). A row's result never
depends on the other rows, the chunk or the thread that computes it (the kernels' docstrings give the order).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..model.quants import QK
from ..model.weights import Projection, QMatrix
from . import kernels


class Activations(NamedTuple):
    """A matmul input's 8-bit block codes, from kernels.quantize_blocks (see there): xq int8 [T, n_in],
    dx float32 [T, n_in // 32] (block scales), sx int32 [T, n_in // 16] (half-block sums of the codes)."""

    xq: np.ndarray
    dx: np.ndarray
    sx: np.ndarray

    @classmethod
    def empty(cls, T: int, n_in: int) -> "Activations":
        """Uninitialized C-contiguous arrays for T inputs of width n_in (a multiple of 32)."""
        nb = n_in // QK
        return cls(np.empty((T, n_in), np.int8), np.empty((T, nb), np.float32), np.empty((T, 2 * nb), np.int32))

    @classmethod
    def of(cls, x: np.ndarray) -> "Activations":
        """The codes of x (float32 [T, n_in], n_in a multiple of 32) in new arrays."""
        a = cls.empty(*x.shape)
        kernels.quantize_blocks(x, *a)
        return a


def matmul(m: QMatrix, x: np.ndarray, xq: Activations, out: np.ndarray) -> None:
    """out[T, n_out] = x[T, n_in] @ W.T for one repacked matrix; xq: the codes of x (filled by the caller)."""
    if m.kind == "q":
        slices = kernels.token_slices(m.arrays[2].shape[0], x.shape[0])
        kernels.matmul_q(*m.arrays, *xq, slices, out)
    else:
        kernels.matmul_dense(*m.arrays, x, out)


def project(p: Projection, x: np.ndarray, xq: Activations, out: np.ndarray) -> None:
    """out[T, n_out] (float32, C-contiguous) = x[T, n_in] @ [W_0; W_1; ...].T, with xq the codes of x.

    A projection whose tensors change type holds one matrix per run of one type: each writes through its own
    buffer (kept in ``p.buffers`` per chunk size), copied into its columns of ``out``, since the kernels write
    whole contiguous rows (vectorized across rows) and a column slice of ``out`` is not one."""
    if len(p.mats) == 1:
        matmul(p.mats[0], x, xq, out)
        return
    T, col = x.shape[0], 0
    for i, m in enumerate(p.mats):
        buf = p.buffers.get((T, i))
        if buf is None:
            buf = p.buffers[(T, i)] = np.empty((T, m.n_out), np.float32)
        matmul(m, x, xq, buf)
        out[:, col : col + m.n_out] = buf
        col += m.n_out
