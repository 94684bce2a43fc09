"""The native GEMMs: XLA FFI custom calls into the ``jaxmx._ffi`` extension.

Four custom-call targets, each with a CPU handler (plain C++, always built) and a cuBLASLt handler
(built with ``JAXMX_CUDA=ON``, see docs/native.md):

- ``jaxmx_mx_matmul``: MXFP8 operands (E4M3 / E5M2 codes, one E8M0 scale per 32 elements along
  K, scales in the cuBLAS 128x4 tiled layout); cuBLASLt ``VEC32_UE8M0`` block scaling, which
  needs compute capability >= 10.0 and CUDA >= 12.8.
- ``jaxmx_fp8_matmul``: FP8 operands with one float32 scale per tensor (cuBLASLt
  ``SCALAR_32F``, compute capability >= 8.9, so Hopper too).
- ``jaxmx_block_fp8_matmul``: block-FP8 operands (``fp8_e4m3_block`` / ``fp8_e5m2_block``: one
  float32 scale per 1x128 block along K, or per 128x128 tile for one of the operands); cuBLASLt
  ``VEC128_32F`` / ``BLK128x128_32F`` scaling, compute capability 9.x and CUDA >= 12.9.
- ``jaxmx_fp4_matmul``: FP4 operands, both MXFP4 (E8M0 scales per 32) or both NVFP4 (E4M3
  scales per 16 and a float32 tensor scale each, applied as ``alpha``), E2M1 codes packed two
  per byte; cuBLASLt ``VEC32_UE8M0`` / ``VEC16_UE4M3`` scaling on ``CUDA_R_4F_E2M1``, compute
  capability >= 10.0 and CUDA >= 12.8.

All take TN operands, ``a`` [..., M, K] and ``b`` [..., N, K], and return
``a @ b^T`` [..., M, N] in bfloat16, float16 or float32, accumulated in float32. The MX GEMM also
takes K-first operands ([..., K, rows], quantized along K): untransposed where the default CUDA
device has compute capability 10.x (cuBLASLt's non-TN MXFP8 layouts), transposed to TN form
everywhere else. All are
jitted (one compiled call per shape when called eagerly) and vmappable; the MX and block-FP8
GEMMs are partitioned under SPMD by :mod:`jaxmx._src.gemm.partitioning` (the per-tensor FP8 and the
FP4 GEMMs are not: XLA gathers their operands).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx import ffi
    >>> a = jaxmx.quantize(jnp.ones((4, 64)))
    >>> b = jaxmx.quantize(jnp.full((8, 64), 0.5))
    >>> ffi.mx_matmul(a, b, jnp.float32)[0, :3].tolist()
    [32.0, 32.0, 32.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxmx._src.core import bits
from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.core.formats import formats_of, get_format
from jaxmx._src.core.mxarray import MXArray, check_gemm_pair, checked, swap_last_axes, untiled
from jaxmx._src.core.swizzle import swizzle_scales
from jaxmx._src.core.vma import vary_like
from jaxmx._src.gemm import capabilities, extension
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.dispatch import NATIVE_BLOCK_FP8_TILE, native_pair
from jaxmx._src.gemm.partitioning import partitioned_gemm

MX_TARGET = "jaxmx_mx_matmul"
FP8_TARGET = "jaxmx_fp8_matmul"
BLOCK_FP8_TARGET = "jaxmx_block_fp8_matmul"
FP4_TARGET = "jaxmx_fp4_matmul"

MXFP8_FORMATS = formats_of(gemm="mx")
"""The formats the native MX GEMM takes (MXFP8), in any pair but E5M2 x E5M2 (cuBLASLt's FP8
type table has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3)."""

BLOCK_FP8_FORMATS = formats_of(gemm="block_fp8")
"""The formats the native block-FP8 GEMM takes (1x128 blocks or 128x128 tiles, float32 scales),
in any pair but E5M2 x E5M2."""

FP4_FORMATS = formats_of(gemm="fp4")
"""The formats the native FP4 GEMM takes: both operands MXFP4 or both NVFP4 (E2M1 codes; E8M0
scales per 32 or E4M3 scales per 16 and a float32 tensor scale)."""

WORKSPACE_BYTES = 32 * 1024 * 1024
"""cuBLASLt workspace, allocated by XLA as a second output of the custom call (GPU only), plus
256 bytes so that the handler can hand cuBLASLt a 256-byte aligned part of this size."""

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_N_MULTIPLE = 16  # cuBLASLt: rows of out^T padded so every row of out starts 16-byte aligned


# --- MX GEMM -----------------------------------------------------------------------------------


def mx_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for MXFP8 operands, on the native custom call.

    Args:
        a: [..., M, K] quantized along its last axis (``mxfp8_e4m3`` or ``mxfp8_e5m2``: the TN
            form), or [..., K, M] quantized along K, its axis -2 (a columnwise copy kept
            untransposed, as the training GEMM's gradients use).
        b: [..., N, K] or [..., K, N] likewise, same leading (batch) dims and K.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``, accumulated in float32. The compact scales are swizzled to
        the cuBLAS 128x4 layout right before the call. Where the default CUDA device has compute
        capability 10.x (:attr:`~jaxmx._src.gemm.capabilities.Capabilities.non_tn_mx`) a K-first
        operand's codes go to cuBLASLt untransposed (only its small scale tensor is re-laid);
        everywhere else (12.x, no GPU) its codes and scales are transposed to TN form first. The
        CPU handler takes both layouts and gives the same bits. Works under ``jit``, ``vmap``
        and SPMD partitioning.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.ones((2, 3, 32)))
        >>> b = jaxmx.quantize(jnp.ones((2, 5, 32)), "mxfp8_e5m2")
        >>> ffi.mx_matmul(a, b).shape
        (2, 3, 5)
        >>> a_k_first = jaxmx.quantize(jnp.ones((2, 32, 3)), axis=1)  # [..., K, M]
        >>> ffi.mx_matmul(a_k_first, b, jnp.float32)[0, 0].tolist()
        [32.0, 32.0, 32.0, 32.0, 32.0]
    """
    a, b, out_dtype = _checked_fp8_pair(a, b, out_dtype, "mx_matmul", _check_mx_operand)
    if not capabilities.current().non_tn_mx:
        a, b = tn_form(a), tn_form(b)  # the all-TN path (sm_12x, CPU-only hosts)
    k_first = (_k_first(a), _k_first(b))
    return _mx_call(out_dtype, k_first)(_zero_padding(a), _zero_padding(b), a.scale, b.scale)


def tn_form(q: MXArray) -> MXArray:
    """``q`` in TN form ([..., rows, K] quantized along its last axis): a K-first operand has
    its 1-byte codes and scales transposed."""
    return swap_last_axes(q) if _k_first(q) else q


def _k_first(q: MXArray) -> bool:
    return q.axis == q.ndim - 2


def _checked_fp8_pair(a, b, out_dtype, fn: str, check_operand):
    """``(a, b, out_dtype)`` of an FP8 GEMM ``fn`` after the checks: each operand by
    ``check_operand(q, name)``, the pair (cuBLASLt's type table, equal K and batch dims), the
    output dtype; the custom-call targets registered."""
    a, b = check_operand(a, "a"), check_operand(b, "b")
    _check_type_pair(a, b, fn)
    check_gemm_pair(a, b, fn)
    out_dtype = check_float_dtype(out_dtype, f"{fn}: out_dtype")
    extension.register_targets()
    return a, b, out_dtype


def _check_type_pair(a: MXArray, b: MXArray, fn: str) -> None:
    """cuBLASLt's FP8 type table: E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 (no E5M2 x E5M2)."""
    if not native_pair((a.fmt, b.fmt)):
        raise NotImplementedError(
            f"{fn}: {a.fmt} x {b.fmt} is not supported by the native GEMM (cuBLASLt has E4M3 x "
            "E4M3, E4M3 x E5M2 and E5M2 x E4M3); use the emulation backend, or E4M3 for one "
            "operand"
        )


def _check_mx_operand(q, name: str) -> MXArray:
    """``q`` checked as an MX operand: TN ([..., rows, K] blocked along its last axis) or K-first
    ([..., K, rows] blocked along axis -2)."""
    q = checked(q, f"mx_matmul: {name}")
    _check_format(q, name, "mx_matmul", MXFP8_FORMATS)
    if q.ndim < 2 or q.axis < q.ndim - 2:
        raise ValueError(
            f"mx_matmul: {name} must be [..., rows, K] quantized along its last axis (TN form) "
            f"or [..., K, rows] quantized along axis -2 (K-first), got axis {q.axis} of logical "
            f"shape {q.shape}"
        )
    k = ReducedAxis(q.data_axis, "K", "the contracting dimension")
    check_block_alignment(q.data, "jaxmx.ffi.mx_matmul", name, (k,), q.format.block)
    return q


def _check_format(q: MXArray, name: str, fn: str, formats: tuple[str, ...]) -> None:
    if q.fmt not in formats:
        raise NotImplementedError(
            f"{fn}: {name} is {q.fmt}, which this native GEMM does not support "
            f"(supported: {', '.join(formats)}); use the emulation backend"
        )


def _check_tn_operand(q, name: str, fn: str, formats: tuple[str, ...]) -> MXArray:
    """``q`` checked as a TN operand ([..., rows, K] blocked along K) of one of ``formats``."""
    q = checked(q, f"{fn}: {name}")
    _check_format(q, name, fn, formats)
    if q.ndim < 2 or q.axis != q.ndim - 1:
        raise ValueError(
            f"{fn}: {name} must be [..., rows, K] quantized along its last axis (TN form), "
            f"got axis {q.axis} of logical shape {q.shape}; quantize the transposed tensor "
            "(jaxmx.quantize_rowwise_colwise gives both copies)"
        )
    k = ReducedAxis(q.data_axis, "K", "the contracting dimension")
    check_block_alignment(q.data, f"jaxmx.ffi.{fn}", name, (k,), q.format.block)
    return q


def _zero_padding(q: MXArray) -> jax.Array:
    """The codes of ``q`` with any padding along K set to zero (whatever a hand-built one holds)."""
    k = q.shape[q.axis]
    if k == q.data.shape[q.data_axis]:
        return q.data
    codes = bits.as_bytes(q.data)
    index = lax.broadcasted_iota(jnp.int32, codes.shape, q.data_axis)
    return bits.from_bytes(jnp.where(index < k, codes, 0).astype(jnp.uint8), q.data.dtype)


@functools.cache
def _mx_call(out_dtype, k_first: tuple[bool, bool]):
    # vmap outside, SPMD partitioning inside: each device swizzles the scales of its own blocks.
    # Jitted, so that eager calls hit a compiled-call cache instead of re-tracing. A K-first lhs
    # cannot fold a vmapped batch into its rows (its last axis): the batch stays a batch.
    block = get_format(MXFP8_FORMATS[0]).block
    per_shard = functools.partial(_mx_per_shard, k_first=k_first)
    gemm = partitioned_gemm(per_shard, out_dtype, "jaxmx.ffi.mx_matmul", block, k_first)
    return jax.jit(vmappable(gemm, fold=None if k_first[0] else (True, False, True, False)))


@functools.cache
def _mx_per_shard(out_dtype, k_first: tuple[bool, bool] = (False, False)):
    """The custom call on (one device's) operands: swizzles the compact scales, then calls."""

    def prepare(n_multiple, a_data, b_data, a_scale, b_scale):
        if k_first[1]:
            n = b_data.shape[-1]
            b_data, b_scale = _k_first_operand(b_data, b_scale, n_multiple)
        else:
            b_data, b_scale, n = _pad_rows(b_data, b_scale, n_multiple)
        if k_first[0]:
            a_data, a_scale = _k_first_operand(a_data, a_scale, n_multiple)
        return (a_data, b_data, swizzle_scales(a_scale), swizzle_scales(b_scale)), n

    def impl(a_data, b_data, a_scale, b_scale):
        return _custom_call(
            MX_TARGET,
            "mx_matmul",
            out_dtype,
            prepare,
            a_data,
            b_data,
            a_scale,
            b_scale,
            attributes={"lhs_k_first": k_first[0], "rhs_k_first": k_first[1]},
            k_first=k_first,
        )

    return impl


def _k_first_operand(data, scale, row_multiple: int):
    """A K-first MX operand for the custom call: the codes [..., K, rows] stay untransposed,
    their rows (the leading dimension cuBLASLt sees) padded with zero codes to ``row_multiple``;
    the compact scales [..., K/32, rows] become [..., rows, K/32], padded alike.

    That is the one re-laying a K-first operand needs: cuBLASLt indexes VEC32_UE8M0 scales by
    (row of the operand, K-block) whatever the data layout (ffi/cublaslt_gemm.h).
    """
    pad = [(0, 0)] * (data.ndim - 1) + [(0, -data.shape[-1] % row_multiple)]
    return jnp.pad(data, pad), jnp.pad(bits.as_bytes(scale), pad).swapaxes(-1, -2)


def _pad_rows(data, scale, multiple: int):
    """Zero rows appended to a [..., N, K] operand (and its [..., N, *] scales) up to a multiple.

    Zero codes contribute nothing whatever their scale, and the extra output columns are dropped.
    """
    n = data.shape[-2]
    pad = -n % multiple
    if pad:
        widths = [(0, 0)] * (data.ndim - 2) + [(0, pad), (0, 0)]
        data = jnp.pad(data, widths)
        if scale.ndim == data.ndim:
            scale = jnp.pad(bits.as_bytes(scale), widths)
    return data, scale, n


# --- block-FP8 GEMM ----------------------------------------------------------------------------

BLOCK_TILE = NATIVE_BLOCK_FP8_TILE
"""Block FP8: scales per 1x128 block along K, or per 128x128 tile."""


def block_fp8_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for block-FP8 operands in TN form, on the native custom call.

    Args:
        a: [..., M, K] quantized along its last axis (``fp8_e4m3_block`` or ``fp8_e5m2_block``),
            in 1x128 blocks or 128x128 tiles (``tile=(128, 128)``).
        b: [..., N, K] likewise, same leading (batch) dims and K. E5M2 x E5M2 is not offered
            (cuBLASLt has no such FP8 kernel).
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``, accumulated in float32. cuBLASLt (compute capability 9.x,
        CUDA >= 12.9) takes 1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128 scales: a tiled
        operand goes as 128x128 tiles when its rows are whole tiles (if both do, only ``b``),
        otherwise as 1x128 blocks with each tile's scale repeated over its rows (the same
        numbers). Works under ``jit``, ``vmap`` and SPMD partitioning.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.ones((2, 256)), "fp8_e4m3_block")
        >>> b = jaxmx.quantize(jnp.full((3, 256), 0.5), "fp8_e4m3_block", tile=(128, 128))
        >>> ffi.block_fp8_matmul(a, b, jnp.float32).tolist()
        [[128.0, 128.0, 128.0], [128.0, 128.0, 128.0]]
    """
    a, b, out_dtype = _checked_fp8_pair(a, b, out_dtype, "block_fp8_matmul", _check_block_operand)
    a_tiles, b_tiles = _whole_tiles(a), _whole_tiles(b) and not _whole_tiles(a)
    a, b = untiled(a), untiled(b)
    call = _block_call(out_dtype, a_tiles, b_tiles)
    return call(_zero_padding(a), _zero_padding(b), a.scale, b.scale)


def _check_block_operand(q, name: str) -> MXArray:
    q = _check_tn_operand(q, name, "block_fp8_matmul", BLOCK_FP8_FORMATS)
    if q.tile not in (None, (BLOCK_TILE, BLOCK_TILE)):
        raise ValueError(
            f"block_fp8_matmul: {name} has {q.tile} tiles; the native GEMM takes 1x128 blocks "
            f"or ({BLOCK_TILE}, {BLOCK_TILE}) tiles (use the emulation backend for other tiles)"
        )
    return q


def _whole_tiles(q: MXArray) -> bool:
    """Whether ``q`` can go to cuBLASLt as 128x128 tiles: tiled, its rows whole tiles (so that
    under vmap, which folds a batch into the rows, and per shard the tiles stay aligned)."""
    return q.tile is not None and q.shape[-2] % BLOCK_TILE == 0


@functools.cache
def _block_call(out_dtype, a_tiles: bool, b_tiles: bool):
    # Operands travel as 1x128 blocks (tile scales repeated over their rows), so vmap and SPMD
    # treat them like MX operands; each shard takes back one scale row per tile where it can.
    per_shard = functools.partial(_block_per_shard, tiles=(a_tiles, b_tiles))
    gemm = partitioned_gemm(per_shard, out_dtype, "jaxmx.ffi.block_fp8_matmul", BLOCK_TILE)
    return jax.jit(vmappable(gemm, fold=(True, False, True, False)))


@functools.cache
def _block_per_shard(out_dtype, tiles: tuple[bool, bool] = (False, False)):
    """The custom call on (one device's) operands [..., rows, K] and their per-row scales
    [..., rows, K/128]: scales laid out as cuBLASLt wants them, then the call."""

    def impl(a_data, b_data, a_scale, b_scale):
        # a shard whose rows do not start and end on tile boundaries keeps 1x128 blocks
        a_tiled = tiles[0] and a_data.shape[-2] % BLOCK_TILE == 0
        b_tiled = tiles[1] and b_data.shape[-2] % BLOCK_TILE == 0

        def prepare(n_multiple, a_data, b_data, a_scale, b_scale):
            n = b_data.shape[-2]
            a_data, a_scale = _block_operand(a_data, a_scale, a_tiled, n_multiple)
            b_data, b_scale = _block_operand(b_data, b_scale, b_tiled, n_multiple)
            return (a_data, b_data, a_scale, b_scale), n

        return _custom_call(
            BLOCK_FP8_TARGET,
            "block_fp8_matmul",
            out_dtype,
            prepare,
            a_data,
            b_data,
            a_scale,
            b_scale,
            attributes={"lhs_tiled": a_tiled, "rhs_tiled": b_tiled},
        )

    return impl


def _block_operand(data, scale, tiled: bool, row_multiple: int):
    """Codes and float32 scales in cuBLASLt's block-FP8 layouts (ffi/layout.h).

    1x128 blocks: rows padded with zeros to ``row_multiple``, scales ``[..., K/128, rows]``
    (rows contiguous). 128x128 tiles: scales ``[..., rows/128, roundup(K/128, 4)]``, one row per
    tile (the per-row scales are constant over each tile), zero-padded.
    """
    if tiled:
        pad = [(0, 0)] * (scale.ndim - 1) + [(0, -scale.shape[-1] % 4)]
        return data, jnp.pad(scale[..., ::BLOCK_TILE, :], pad)
    pad = [(0, 0)] * (data.ndim - 2) + [(0, -data.shape[-2] % row_multiple), (0, 0)]
    return jnp.pad(data, pad), jnp.pad(scale, pad).swapaxes(-1, -2)


# --- FP4 GEMM (NVFP4, MXFP4) -------------------------------------------------------------------

FP4_K_MULTIPLE = 32
"""FP4 operands go to the custom call with K padded (zero codes) to a multiple of 32: cuBLASLt
wants 16-byte aligned rows (leading dimensions) of packed E2M1 codes, i.e. 32 elements."""


def fp4_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for FP4 operands in TN form (both MXFP4 or both NVFP4), natively.

    Args:
        a: [..., M, K] quantized along its last axis (``mxfp4`` or ``nvfp4``), in 1-D blocks or
            tiles as wide as the block.
        b: [..., N, K] likewise, same format, leading (batch) dims and K.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``: ``float32(alpha * acc)`` rounded to ``out_dtype``, where
        ``acc`` sums the exact products ``(code_a * s_a) * (code_b * s_b)`` over K in float32
        (exact within each block, blocks added in order by the CPU handler) and ``alpha`` is
        ``float32(g_a * g_b)``, the product of the NVFP4 tensor scales (one per batch element
        under ``vmap``), or 1 for MXFP4. A NaN block scale gives NaN where its block reaches.
        The E2M1 codes are packed two per byte (element ``2i`` in the low nibble), K is padded
        with zero codes to a multiple of 32 and the scales are swizzled to the cuBLAS 128x4
        layout right before the call. Works under ``jit`` and ``vmap``.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.full((2, 16), 10.5), "nvfp4")  # g = 2^-8: values exact
        >>> b = jaxmx.quantize(jnp.full((3, 16), -5.25), "nvfp4")  # g = 2^-9
        >>> ffi.fp4_matmul(a, b, jnp.float32).tolist()
        [[-882.0, -882.0, -882.0], [-882.0, -882.0, -882.0]]
    """
    a = _check_tn_operand(a, "a", "fp4_matmul", FP4_FORMATS)
    b = _check_tn_operand(b, "b", "fp4_matmul", FP4_FORMATS)
    if a.fmt != b.fmt:
        raise NotImplementedError(
            f"fp4_matmul: a is {a.fmt} and b is {b.fmt}; the native FP4 GEMM takes two MXFP4 or "
            "two NVFP4 operands (cuBLASLt scales both with one mode); quantize both in one "
            "format, or use the emulation backend"
        )
    check_gemm_pair(a, b, "fp4_matmul")
    out_dtype = check_float_dtype(out_dtype, "fp4_matmul: out_dtype")
    extension.register_targets()
    nvfp4 = a.format.has_global_scale
    return _fp4_call(out_dtype, nvfp4)(*_fp4_operands(a, b))


@jax.jit
def _fp4_operands(a: MXArray, b: MXArray):
    """The FP4 custom call's operands of checked ``a`` and ``b``: packed codes, compact scale
    bytes and tensor scales. Jitted, so that an eager call runs one compiled program."""
    a, b = untiled(a), untiled(b)
    batch = a.data.shape[:-2]
    return (
        _packed_codes(a),
        _packed_codes(b),
        _fp4_scales(a),
        _fp4_scales(b),
        _tensor_scale(a, batch),
        _tensor_scale(b, batch),
    )


def _packed_codes(q: MXArray) -> jax.Array:
    """uint8 [..., rows, Kp / 2]: the E2M1 codes of ``q`` with the padding of K zeroed (whatever
    a hand-built one holds), K padded to ``Kp``, a multiple of :data:`FP4_K_MULTIPLE`, and two
    codes per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.

    That is CUDA's ``__nv_fp4x2`` storage, which cuBLASLt reads for ``CUDA_R_4F_E2M1``
    (cuda_fp4.hpp, ``__nv_cvt_double2_to_fp4x2``: ``.x`` in bits 0-3, ``.y`` in bits 4-7; the
    CUDALibrarySamples cuBLASLt LtNvfp4Matmul sample passes such arrays as A and B).
    """
    nibbles = lax.bitcast_convert_type(q.data, jnp.uint4).astype(jnp.uint8)
    index = lax.broadcasted_iota(jnp.int32, nibbles.shape, nibbles.ndim - 1)
    nibbles = jnp.where(index < q.shape[-1], nibbles, jnp.uint8(0))
    pad = -nibbles.shape[-1] % FP4_K_MULTIPLE
    nibbles = jnp.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, pad)])
    return bits.pack_nibbles(nibbles)


def _fp4_scales(q: MXArray) -> jax.Array:
    """uint8 [..., rows, Kp / block]: the compact scale bytes, K padded like the codes (the
    extra blocks get byte 0; their codes are zero)."""
    scale = bits.as_bytes(q.scale, "scales", (jnp.dtype(jnp.uint8), q.format.scale_dtype))
    pad = -q.data.shape[-1] % FP4_K_MULTIPLE // q.format.block
    return jnp.pad(scale, [(0, 0)] * (scale.ndim - 1) + [(0, pad)])


def _tensor_scale(q: MXArray, batch: tuple[int, ...]) -> jax.Array:
    """float32 [*batch]: ``q``'s NVFP4 tensor scale (shaped like the leading dims it varies
    over, e.g. under ``vmap``) over the operand's batch dims, or ones for MXFP4."""
    if q.global_scale is None:
        return jnp.ones(batch, jnp.float32)
    g = q.global_scale
    return jnp.broadcast_to(g.reshape(g.shape + (1,) * (len(batch) - g.ndim)), batch)


@functools.cache
def _fp4_call(out_dtype, nvfp4: bool):
    """The FP4 custom call on (a, b, compact scale bytes, tensor scales): rhs rows padded, scales
    swizzled, ``alpha_beta = (float32(g_a * g_b), 0)`` per GEMM (cuBLASLt reads both from
    device memory)."""

    def prepare(n_multiple, a, b, a_scale, b_scale, a_g, b_g):
        b, b_scale, n = _pad_rows(b, b_scale, n_multiple)
        alpha = a_g * b_g
        alpha_beta = jnp.stack([alpha, jnp.zeros_like(alpha)], axis=-1)
        return (a, b, swizzle_scales(a_scale), swizzle_scales(b_scale), alpha_beta), n

    def impl(*args):
        return _custom_call(
            FP4_TARGET, "fp4_matmul", out_dtype, prepare, *args, attributes={"nvfp4": nvfp4}
        )

    return jax.jit(vmappable(impl, fold=(True, False, True, False, False, False)))


# --- per-tensor FP8 GEMM --------------------------------------------------------------------


def fp8_matmul(
    a_fp8, b_fp8, a_scale, b_scale, out_dtype=jnp.bfloat16, *, fast_accum: bool = False
) -> jax.Array:
    """``(a_scale * b_scale) * (a @ b^T)`` for FP8 operands with per-tensor float32 scales.

    The cuBLASLt FP8 GEMM (compute capability >= 8.9, Hopper included) through the same
    machinery as :func:`mx_matmul`; on CPU the C++ handler.

    Args:
        a_fp8: [..., M, K] float8_e4m3fn or float8_e5m2.
        b_fp8: [..., N, K], same leading dims and K; E5M2 x E5M2 is not offered (cuBLASLt has
            no such kernel). K must be a multiple of 16 (a cuBLASLt FP8 requirement).
        a_scale, b_scale: float32 scalars (or one per batch element, shaped like the batch dims)
            that dequantize the operands: ``a = a_scale * a_fp8``.
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: cuBLASLt's FP8 fast accumulation (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``):
            faster on Hopper, with partial sums promoted to full float32 less often; meant for
            forward GEMMs (gradients keep the default). The CPU handler ignores it.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx import ffi
        >>> a = jnp.ones((2, 16), jnp.float8_e4m3fn)
        >>> ffi.fp8_matmul(a, a, 0.5, 2.0, jnp.float32).tolist()
        [[16.0, 16.0], [16.0, 16.0]]
    """
    a_fp8, b_fp8 = jnp.asarray(a_fp8), jnp.asarray(b_fp8)
    for name, x in (("a_fp8", a_fp8), ("b_fp8", b_fp8)):
        if x.dtype not in _FP8_DTYPES:
            raise TypeError(
                f"fp8_matmul: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}"
            )
        if x.ndim < 2:
            raise ValueError(f"fp8_matmul: {name} must be [..., rows, K], got shape {x.shape}")
    if a_fp8.dtype == b_fp8.dtype == jnp.float8_e5m2:
        raise TypeError(
            "fp8_matmul: float8_e5m2 x float8_e5m2 is not supported (cuBLASLt has no such FP8 "
            "kernel); make one operand float8_e4m3fn"
        )
    if a_fp8.shape[-1] != b_fp8.shape[-1]:
        raise ValueError(
            f"fp8_matmul: contracting sizes differ: a {a_fp8.shape} vs b {b_fp8.shape} "
            "(operands are [..., M, K] and [..., N, K])"
        )
    if a_fp8.shape[-1] % 16:
        raise ValueError(f"fp8_matmul: K must be a multiple of 16, got {a_fp8.shape[-1]}")
    batch = a_fp8.shape[:-2]
    if b_fp8.shape[:-2] != batch:
        raise ValueError(f"fp8_matmul: batch dimensions differ: a {batch} vs b {b_fp8.shape[:-2]}")
    scales = []
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        s = jnp.asarray(s)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            raise TypeError(f"fp8_matmul: {name} must be a float scale, got {s.dtype}")
        if s.shape not in ((), batch):
            raise ValueError(
                f"fp8_matmul: {name} must be a scalar or have the batch shape {batch}, got "
                f"{s.shape}"
            )
        scales.append(jnp.broadcast_to(s.astype(jnp.float32), batch))
    out_dtype = check_float_dtype(out_dtype, "fp8_matmul: out_dtype")
    extension.register_targets()
    return _fp8_call(out_dtype, bool(fast_accum))(a_fp8, b_fp8, *scales)


@functools.cache
def _fp8_call(out_dtype, fast_accum: bool):
    def prepare(n_multiple, a_fp8, b_fp8, a_scale, b_scale):
        b_fp8, _, n = _pad_rows(b_fp8, b_scale, n_multiple)
        return (a_fp8, b_fp8, a_scale, b_scale), n

    def impl(a_fp8, b_fp8, a_scale, b_scale):
        return _custom_call(
            FP8_TARGET,
            "fp8_matmul",
            out_dtype,
            prepare,
            a_fp8,
            b_fp8,
            a_scale,
            b_scale,
            attributes={"fast_accum": fast_accum},
        )

    return jax.jit(vmappable(impl, fold=(True, False, False, False)))


# --- per-tensor and per-row FP8 MXArrays on the per-tensor FP8 GEMM ---------------------------

CURRENT_FP8_FORMATS = formats_of(gemm="fp8")
"""The per-tensor and per-row FP8 formats (torchao's current scaling), which run on the per-tensor
FP8 GEMM (:func:`fp8_matmul`) in any pair but E5M2 x E5M2."""

FP8_K_MULTIPLE = 16
"""cuBLASLt's FP8 GEMM wants K a multiple of 16: :func:`current_fp8_matmul` pads K with zero
codes to one (they contribute nothing)."""


def current_fp8_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16, *, fast_accum=False):
    """``a @ b^T`` for per-tensor or per-row FP8 operands on the native per-tensor FP8 GEMM.

    Args:
        a: [..., M, K] or [..., K, M] quantized along K (``fp8_e4m3_tensor``,
            ``fp8_e5m2_tensor``, ``fp8_e4m3_row``, ``fp8_e5m2_row``).
        b: [..., N, K] or [..., K, N] likewise, same leading (batch) dims and K. E5M2 x E5M2 is
            not offered (cuBLASLt has no such FP8 kernel).
        out_dtype: bfloat16 (default), float16 or float32.
        fast_accum: cuBLASLt's FP8 fast accumulation (:func:`fp8_matmul`).

    Returns:
        [..., M, N] in ``out_dtype``. A K-first operand's codes are transposed to TN form first
        and K is padded with zero codes to a multiple of 16. Two per-tensor operands: the float32
        sum of the products of codes ``acc`` times their decode factors ``1/s_a`` and ``1/s_b``
        (float32 quotients), as cuBLASLt applies them (``SCALAR_32F``), rounded once to
        ``out_dtype``. Otherwise (a per-row operand): the same GEMM with unit scales in float32,
        then ``acc[m, n] / (s_a[m] * s_b[n])``, the scales' mantissas multiplied and divided out
        (two float32 roundings) and their exponents applied exactly (no intermediate overflow or
        underflow; exact for ``pow2`` scales), then ``out_dtype``. Equal to the emulation up to
        float32 rounding (docs/native.md states the bound). Works under ``jit`` and ``vmap``.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx._src.gemm.native import current_fp8_matmul
        >>> a = jaxmx.quantize(jnp.ones((2, 24)), "fp8_e4m3_tensor")  # K = 24: padded to 32
        >>> b = jaxmx.quantize(jnp.full((3, 24), 0.5), "fp8_e4m3_row")
        >>> current_fp8_matmul(a, b, jnp.float32).tolist()
        [[12.0, 12.0, 12.0], [12.0, 12.0, 12.0]]
    """
    fn = "current_fp8_matmul"
    a, b, out_dtype = _checked_fp8_pair(a, b, out_dtype, fn, _check_current_operand)
    a, b = tn_form(a), tn_form(b)
    a_codes, b_codes = tn_codes(a), tn_codes(b)
    if a.format.span == b.format.span == "tensor":
        factors = (_decode_factor(q) for q in (a, b))
        return fp8_matmul(a_codes, b_codes, *factors, out_dtype, fast_accum=fast_accum)
    acc = fp8_matmul(a_codes, b_codes, 1.0, 1.0, jnp.float32, fast_accum=fast_accum)
    return row_scaled(acc, a.scale[..., 0], b.scale[..., 0]).astype(out_dtype)


def _check_current_operand(q, name: str) -> MXArray:
    """``q`` checked as an operand of :func:`current_fp8_matmul` (TN or K-first, as for MX)."""
    q = checked(q, f"current_fp8_matmul: {name}")
    _check_format(q, name, "current_fp8_matmul", CURRENT_FP8_FORMATS)
    if q.ndim < 2 or q.axis < q.ndim - 2:
        raise ValueError(
            f"current_fp8_matmul: {name} must be [..., rows, K] or [..., K, rows] quantized "
            f"along K, got axis {q.axis} of logical shape {q.shape}"
        )
    return q


def tn_codes(q: MXArray) -> jax.Array:
    """The codes of a per-tensor or per-row ``q`` as :func:`current_fp8_matmul` hands them to
    the GEMM: [..., rows, Kp] (TN form), K padded with zero codes to ``Kp``, a multiple of
    :data:`FP8_K_MULTIPLE`."""
    codes = tn_form(q).data
    pad = -codes.shape[-1] % FP8_K_MULTIPLE
    if not pad:
        return codes
    padded = jnp.pad(bits.as_bytes(codes), [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    return bits.from_bytes(padded, codes.dtype)


def _decode_factor(q: MXArray) -> jax.Array:
    """``1 / scale`` of a per-tensor ``q`` (float32, rounded once), shaped like its batch dims:
    the factor :func:`fp8_matmul` multiplies its codes by."""
    scale = q.scale.reshape(q.scale.shape[:-2])
    return jnp.broadcast_to(bits.divide(1.0, scale), q.data.shape[:-2])


def row_scaled(acc: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:
    """``acc[..., m, n] / (a_scale[..., m] * b_scale[..., n])`` in float32 for normal float32
    scales (NaN passes through): each scale split into its mantissa ``f`` in [1, 2) and its
    exponent ``e``, ``acc / (f_a * f_b)`` (two roundings), then ``2^-(e_a + e_b)`` applied with
    one rounding (:func:`~jaxmx._src.core.bits.ldexp_rounded`), so no intermediate product
    overflows or underflows. Exact up to that rounding of ``acc`` for power-of-two scales.

    Example:
        >>> import jax.numpy as jnp
        >>> row_scaled(jnp.full((1, 2), 6.0), jnp.float32([2.0**100]), jnp.float32([3.0, 2.0**-90]))
        Array([[1.5777218e-30, 5.8593750e-03]], dtype=float32)
    """
    fa, ea = _mantissa_exponent(a_scale[..., :, None])
    fb, eb = _mantissa_exponent(b_scale[..., None, :])
    return bits.ldexp_rounded(bits.divide(acc, fa * fb), -(ea + eb))


def _mantissa_exponent(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(f, e)`` with ``s = f * 2^e``, ``f`` in [1, 2), of normal float32 ``s`` (NaN: f NaN)."""
    u = bits.to_bits(s)
    f = bits.from_bits((u & bits.MANTISSA_MASK) | 0x3F800000)
    e = ((u >> bits.MANTISSA_BITS) & 0xFF) - 127
    return jnp.where(jnp.isnan(s), jnp.nan, f), e


# --- the custom call on each platform --------------------------------------------------------

# (platform, workspace bytes, rows of the rhs padded to a multiple of)
_PLATFORMS = (("cpu", 0, 1), ("cuda", WORKSPACE_BYTES + 256, _N_MULTIPLE))


def _custom_call(
    target: str, fn: str, out_dtype, prepare, *args, attributes=None, k_first=(False, False)
) -> jax.Array:
    """``target`` on ``(a, b, a_scale, b_scale)`` with the custom call's ``attributes``, lowered
    per platform.

    ``prepare(n_multiple, *args)`` gives the custom call's operands, the rhs rows padded to
    ``n_multiple``, and the number of output columns to keep. ``k_first``: whether ``a`` and
    ``b`` are [..., K, rows] instead of [..., rows, K] (the MX GEMM). Platforms without a
    handler (:meth:`~jaxmx._src.gemm.capabilities.Capabilities.handler`) get a branch that
    fails at lowering with the reason.
    """

    def rows(x, k_first_operand: bool) -> int:
        return x.shape[-1] if k_first_operand else x.shape[-2]

    def branch(workspace: int, n_multiple: int):
        def run(*args):
            operands, n = prepare(n_multiple, *args)
            out_shape = (*operands[0].shape[:-2], rows(operands[0], k_first[0]))
            out_shape += (rows(operands[1], k_first[1]),)
            out, _ = jax.ffi.ffi_call(
                target,
                (
                    jax.ShapeDtypeStruct(out_shape, out_dtype),
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8),
                ),
            )(*operands, **(attributes or {}))
            # the operands' rows, padded for cuBLASLt, sliced back; inside shard_map: varying
            # like the operands (ffi_call results are not)
            return vary_like(out[..., : rows(args[0], k_first[0]), :n], *args)

        return run

    branches = {
        platform: branch(workspace, n_multiple)
        for platform, workspace, n_multiple in _PLATFORMS
        if capabilities.current().handler(platform) == "available"
    }

    def unsupported(*args):
        a, b = args[0], args[1]
        out = _unsupported_p.bind(
            *args,
            shape=(*a.shape[:-2], rows(a, k_first[0]), rows(b, k_first[1])),
            dtype=out_dtype,
            fn=fn,
            handled=tuple(branches),
        )
        return vary_like(out, *args)

    return lax.platform_dependent(*args, **branches, default=unsupported)


# The default branch of the custom calls: lowering it (for a platform without a handler) raises.
_unsupported_p = Primitive("jaxmx_ffi_unsupported_platform")
_unsupported_p.def_abstract_eval(
    lambda *args, shape, dtype, fn, handled: jax.core.ShapedArray(shape, dtype)
)
_unsupported_p.def_impl(
    lambda *args, **params: jax.jit(functools.partial(_unsupported_p.bind, **params))(*args)
)


def _unsupported_lowering(ctx, *args, shape, dtype, fn, handled):
    platforms = [p for p in ctx.module_context.platforms if p not in handled]
    here = capabilities.current()
    reasons = "; ".join(f"{p}: {here.handler(p)}" for p in platforms)
    raise RuntimeError(
        f"jaxmx.ffi.{fn}: the native GEMM (backend='ffi') has no handler for platform "
        f"{', '.join(repr(p) for p in platforms) or 'this platform'} ({reasons or 'unknown'}); "
        "use backend='emulate' there"
    )


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
