"""MXArray: MX-quantized data plus E8M0 block scales, as a JAX pytree.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((4, 40)), "mxfp8_e4m3")
    >>> q.data.shape, q.scale.shape, q.shape
    ((4, 64), (4, 2), (4, 40))
    >>> jax.tree.leaves(q)[0].dtype
    dtype(float8_e4m3fn)
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp

from jaxmx._src.formats import Format, get_format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A tensor quantized in blocks along one axis.

    Attributes:
        data: element codes, the logical shape padded along ``axis`` to a multiple of the block
            (padding codes are zero; consumers ignore them).
        scale: ``float8_e8m0fnu`` block scales; ``data``'s shape with ``axis`` divided by the block.
        fmt: the format name (static).
        axis: the (non-negative) block axis (static).
        shape: the logical, unpadded shape (static).

    Under ``vmap`` the leaves may carry extra leading dimensions that ``shape`` does not list.
    Every jaxmx function that consumes an MXArray checks it first (:func:`checked`), so a
    hand-built one with inconsistent fields raises instead of giving wrong numbers.
    """

    data: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def format(self) -> Format:
        """The :class:`~jaxmx.Format` of the elements."""
        return get_format(self.fmt)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def data_axis(self) -> int:
        """The index of the block axis among the axes of ``data`` (which may have more or fewer
        leading dims than ``shape`` under ``vmap``)."""
        return self.axis + self.data.ndim - self.ndim

    @property
    def nbytes(self) -> int:
        """Storage of data and scales in bytes (E2M1 counted as half a byte per element)."""
        return self.data.size * self.format.bits // 8 + self.scale.size

    def __repr__(self) -> str:
        return f"MXArray(fmt={self.fmt!r}, shape={self.shape}, axis={self.axis})"


def padded_shape(shape: tuple[int, ...], axis: int, block: int) -> tuple[int, ...]:
    """``shape`` with ``axis`` rounded up to a multiple of ``block`` (the shape of the codes)."""
    return (*shape[:axis], -(-shape[axis] // block) * block, *shape[axis + 1 :])


def scale_shape(shape: tuple[int, ...], axis: int, block: int) -> tuple[int, ...]:
    """The shape of the block scales of a tensor of logical ``shape`` blocked along ``axis``."""
    return (*shape[:axis], -(-shape[axis] // block), *shape[axis + 1 :])


def swap_last_axes(q: MXArray) -> MXArray:
    """``q`` [..., A, B] blocked along A, stored transposed: [..., B, A] blocked along axis -1.

    Only the 1-byte codes and the scales move. E.g. a columnwise copy quantized along M of
    ``x [M, K]`` becomes the TN operand ``[K, M]`` of a GEMM that reduces M.
    """
    shape = (*q.shape[:-2], q.shape[-1], q.shape[-2])
    return MXArray(q.data.swapaxes(-1, -2), q.scale.swapaxes(-1, -2), q.fmt, len(shape) - 1, shape)


def check_gemm_pair(a: MXArray, b: MXArray, where: str) -> None:
    """Two checked GEMM operands, each blocked along K: the same K and the same batch dims."""
    if a.shape[a.axis] != b.shape[b.axis]:
        raise ValueError(
            f"{where}: contracting sizes differ: a has K = {a.shape[a.axis]}, b has "
            f"K = {b.shape[b.axis]}"
        )
    if a.data.shape[:-2] != b.data.shape[:-2]:
        raise ValueError(
            f"{where}: batch dimensions differ: a {a.data.shape[:-2]} vs b "
            f"{b.data.shape[:-2]} (data shapes {a.data.shape} and {b.data.shape})"
        )


def checked(q, where: str) -> MXArray:
    """``q`` with ``jax.Array`` leaves, after checking that its fields agree with each other.

    Raises a TypeError or ValueError naming ``where`` and the field at fault: the format, the
    axis, the logical shape, the dtypes of codes and scales, and the shapes of codes and scales
    (which may have extra leading dimensions, the same for both, as under ``vmap``).
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"{where}: expected an MXArray, got {type(q).__name__}")
    f = get_format(q.fmt)
    shape = _shape(q.shape, where)
    if isinstance(q.axis, bool) or not _is_index(q.axis) or not 0 <= q.axis < len(shape):
        raise ValueError(f"{where}: MXArray axis {q.axis!r} is not an axis of shape {shape}")
    data, scale = jnp.asarray(q.data), jnp.asarray(q.scale)
    if data.dtype != f.dtype:
        raise TypeError(f"{where}: an {f.name} MXArray holds {f.dtype} codes, got {data.dtype}")
    if scale.dtype != jnp.float8_e8m0fnu:
        raise TypeError(f"{where}: MXArray scales must be float8_e8m0fnu, got {scale.dtype}")
    want_data = padded_shape(shape, q.axis, f.block)
    want_scale = scale_shape(shape, q.axis, f.block)
    # Under vmap the leaves gain leading dims, or lose the logical shape's leading dims (an
    # MXArray built outside and vmapped over): compare the trailing dims, block axis included.
    n = min(data.ndim, len(shape))
    consistent = (
        len(shape) - q.axis <= n  # the block axis is among the leaves' dims
        and data.ndim == scale.ndim
        and data.shape[: data.ndim - n] == scale.shape[: scale.ndim - n]
        and data.shape[data.ndim - n :] == want_data[len(shape) - n :]
        and scale.shape[scale.ndim - n :] == want_scale[len(shape) - n :]
    )
    if not consistent:
        raise ValueError(
            f"{where}: an MXArray of logical shape {shape} blocked along axis {q.axis} holds "
            f"codes of shape {want_data} and scales of shape {want_scale} (give or take "
            f"leading batch dims), got codes {data.shape} and scales {scale.shape}"
        )
    return MXArray(data, scale, f.name, q.axis, shape)


def _shape(shape, where: str) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(_is_index(d) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{where}: MXArray shape must be a tuple of sizes, got {shape!r}")
    return tuple(operator.index(d) for d in dims)


def _is_index(x) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
