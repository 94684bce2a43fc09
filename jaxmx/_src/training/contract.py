"""The contract every custom-VJP training GEMM shares (docs/architecture.md): its types, its
quantize-where-used operands, its GEMM call, its residual names and its observer legs.

A training GEMM (:func:`jaxmx.dot_general`, :func:`jaxmx.ragged_dot`,
:func:`jaxmx.fsdp_dot_general`) is built from these names:

- :class:`Static`: the static argument of its custom VJP; :class:`Dims`: ``dimension_numbers``
  checked and split, :func:`canonical_operands`: the operands as ``[B, M, K]`` and
  ``[B, N, K]`` (or ``[B, K, N]``);
- :class:`Operand`: a high-precision operand with the format and axis it is quantized along,
  quantized where the GEMM uses it (:func:`quantized`, :func:`tiled` for weight tiles;
  :func:`per_tensor`: whether one copy serves every axis);
- :func:`gemm`: one GEMM on the kernels the dispatcher chooses (their properties, never their
  names, say how its operands are quantized and whether it runs partitioned), :func:`fprop`:
  the forward GEMM as remat policies see a stock ``lax.dot_general``;
- :func:`named` and :func:`named_input`: a saved residual under its remat name
  (:data:`LHS_COLWISE`, ...); :func:`vma_like`: a cotangent typed like its primal inside
  ``shard_map``;
- :func:`observed` and :func:`observed_gradient`: the legs reported to the active observer
  (:mod:`jaxmx._src.training.scope`).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> x, w = jnp.ones((1, 4, 32)), jnp.ones((1, 8, 32))
    >>> a, b = Operand(x=x, fmt="mxfp8_e4m3", axis=-1), Operand(x=w, fmt="mxfp8_e4m3", axis=-1)
    >>> gemm(jaxmx.recipes.MXFP8, a, b, jnp.float32)[0, 0, 0].item()
    32.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxmx._src.core.dtypes import to_bits
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxbits import MXBits, as_bits
from jaxmx._src.core.recipes import Recipe
from jaxmx._src.core.vma import varying_axes
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.gathered import Quantized, gathered_gemm, quantized_inside
from jaxmx._src.gemm.kernels import Kernel, execute
from jaxmx._src.quantize.fake import quantize_to_grid
from jaxmx._src.quantize.local_quantize import local_quantize
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.training import scope
from jaxmx._src.training.remat import opaque, presented_as_dot

LHS_COLWISE = "jaxmx_lhs_colwise"
RHS_COLWISE = "jaxmx_rhs_colwise"
LHS_INPUT = "jaxmx_lhs"
RHS_INPUT = "jaxmx_rhs"
"""``checkpoint_name`` s of the residuals (quantized default, then high precision), for remat
policies such as ``jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Static:
    """The static argument of a training GEMM's custom VJP (hashable).

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> s = Static(recipe=jaxmx.recipes.MXFP8, out_dtype=jnp.float32,
        ...            lhs_dtype=jnp.float32, rhs_dtype=jnp.float32)
        >>> weight_axes(s)
        (-1, -2)
    """

    recipe: Recipe
    out_dtype: jnp.dtype
    lhs_dtype: jnp.dtype  # the gradients' dtypes
    rhs_dtype: jnp.dtype
    training_problems: tuple[str, ...] = ()  # block misalignments only a gradient runs into
    out_shape: tuple[int, ...] = ()  # lax.dot_general's result: batch, lhs free, rhs free dims
    n_batch: int = 0  # the number of batch dimensions of dimension_numbers
    gemm_shape: tuple[int, ...] = ()  # [B, M, N]: the canonical GEMM's result
    rhs_k_first: bool = False  # w is [B, K, N] instead of [B, N, K]
    observe_grad: Callable | None = None  # a scope.Tap's backward: (dgrad leg, wgrad leg) -> ct


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
    """``dimension_numbers`` checked against the shapes, with the free dimensions of each side.

    Example:
        >>> Dims.of((4, 32), (8, 32), (((1,), (1,)), ((), ()))).gemm_shape((4, 32), (8, 32))
        (1, 4, 8)
    """

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]

    @classmethod
    def of(cls, lhs_shape, rhs_shape, dimension_numbers) -> Dims:
        try:
            (lc, rc), (lb, rb) = dimension_numbers
            lc, rc, lb, rb = (tuple(operator.index(d) for d in ds) for ds in (lc, rc, lb, rb))
        except (TypeError, ValueError):
            raise TypeError(
                "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
            ) from None
        for side, shape, ds in (("lhs", lhs_shape, lc + lb), ("rhs", rhs_shape, rc + rb)):
            if any(not 0 <= d < len(shape) for d in ds) or len(set(ds)) != len(ds):
                raise ValueError(
                    f"dimension_numbers {dimension_numbers!r}: {side} dimensions {ds} must be "
                    f"distinct and within its rank {len(shape)}"
                )
        for kind, ls, rs in (("contracting", lc, rc), ("batch", lb, rb)):
            lsizes = tuple(lhs_shape[d] for d in ls)
            rsizes = tuple(rhs_shape[d] for d in rs)
            if lsizes != rsizes:
                raise ValueError(
                    f"jaxmx.dot_general: {kind} dimensions differ in size: lhs {ls} has "
                    f"{lsizes}, rhs {rs} has {rsizes}"
                )
        lf = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
        rf = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
        return cls(
            lhs_contract=lc, rhs_contract=rc, lhs_batch=lb, rhs_batch=rb, lhs_free=lf, rhs_free=rf
        )

    def out_shape(self, lhs_shape, rhs_shape) -> tuple[int, ...]:
        """``lax.dot_general``'s result shape: batch, lhs free, then rhs free dimensions."""
        lhs_dims = self.lhs_batch + self.lhs_free
        return tuple(lhs_shape[d] for d in lhs_dims) + tuple(rhs_shape[d] for d in self.rhs_free)

    def gemm_shape(self, lhs_shape, rhs_shape) -> tuple[int, int, int]:
        """[B, M, N]: the canonical GEMM's result (batch, free dimensions each merged)."""
        b = math.prod(lhs_shape[d] for d in self.lhs_batch)
        m = math.prod(lhs_shape[d] for d in self.lhs_free)
        return b, m, math.prod(rhs_shape[d] for d in self.rhs_free)


def canonical_operands(dims: Dims, lhs, rhs, rhs_k_first: bool = False):
    """``lhs`` as ``[B, M, K]`` and ``rhs`` as ``[B, N, K]`` (batch, free and contracting
    dimensions each merged into one), or with ``rhs_k_first`` as ``[B, K, N]`` (a reshape of
    ``rhs`` stored that way: batch, then contracting, then free dimensions)."""
    b = math.prod(lhs.shape[d] for d in dims.lhs_batch)
    m = math.prod(lhs.shape[d] for d in dims.lhs_free)
    n = math.prod(rhs.shape[d] for d in dims.rhs_free)
    k = math.prod(lhs.shape[d] for d in dims.lhs_contract)
    x = lhs.transpose(dims.lhs_batch + dims.lhs_free + dims.lhs_contract).reshape(b, m, k)
    if rhs_k_first:
        return x, rhs.reshape(b, k, n)
    return x, rhs.transpose(dims.rhs_batch + dims.rhs_free + dims.rhs_contract).reshape(b, n, k)


def weight_axes(static: Static) -> tuple[int, int]:
    """The axes of the canonical weight along K and along N."""
    return (-2, -1) if static.rhs_k_first else (-1, -2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
    """A high-precision GEMM operand [B, rows, K] (``axis=-1``) or [B, K, rows] (``axis=-2``,
    a columnwise copy kept in place: the GEMM contracts it K-first), quantized where used; also
    the leg an observer is told of (``key`` aside).

    Example:
        >>> import jax.numpy as jnp
        >>> Operand(x=jnp.ones((1, 4, 32)), fmt="mxfp8_e4m3", axis=-1).key is None
        True
    """

    x: jax.Array
    fmt: str
    axis: int
    key: jax.Array | None = None


def per_tensor(fmt: str) -> bool:
    """Whether ``fmt`` has one scale per tensor: its quantization does not depend on the axis,
    so the forward GEMM's copy of an operand, relabelled (``along``), is also its columnwise
    copy, and the output gradient's one copy serves both backward GEMMs."""
    return get_format(fmt).span == "tensor"


# The quantizers are jitted so that eager (un-jitted) callers run one compiled kernel per copy;
# under an outer jit they inline. (Jitting a custom-VJP GEMM as a whole would hide the residual
# names from remat policies.)
@functools.partial(jax.jit, static_argnames=("fmt", "axis", "scale_mode", "to_values"))
def quantized(x, key=None, *, fmt: str, axis: int, scale_mode: str, to_values: bool):
    """``x`` quantized along ``axis``: an MXArray, or with ``to_values`` a GridArray."""
    quantizer = quantize_to_grid if to_values else quantize
    return quantizer(x, fmt, axis=axis, scale_mode=scale_mode, key=key)


@functools.partial(jax.jit, static_argnums=(1, 2))
def tiled(w, fmt: str, r: Recipe) -> MXArray:
    """w [B, N, K] in ``r.weight_tile`` tiles: one copy for the forward and dgrad GEMMs, each
    device quantizing the tiles of its shard (:func:`local_quantize`)."""
    f = get_format(fmt)
    if f.span != "block" or jax.sharding.get_abstract_mesh().manual_axes:
        return quantize(w, fmt, axis=-1, scale_mode=r.scale_mode, tile=r.weight_tile)
    return local_quantize(w, fmt, r.scale_mode, r.weight_tile)


def gemm(
    r: Recipe,
    a: Operand | MXArray,
    b: Operand | MXArray,
    out_dtype,
    forward: bool = False,
    like=None,
) -> jax.Array:
    """The GEMM of two operands, each an MXArray (a residual, a tiled weight) or an
    :class:`Operand`, on the kernels the dispatcher (:mod:`jaxmx._src.gemm.dispatch`) chooses,
    run by :func:`~jaxmx._src.gemm.kernels.execute`.

    Where the kernel takes element values (``Kernel.takes_values``: the emulation of an MX GEMM
    in 1-D blocks with float32 accumulation), an ``Operand`` is quantized straight to element
    values (:func:`~jaxmx._src.quantize.fake.quantize_to_grid`): it is quantized only to be
    decoded again, and skipping the codes gives the same result, bit for bit, in less time.
    Every other kernel takes MXArrays.

    ``forward``: the forward GEMM (the kernels' ``"forward"`` runners: the native per-tensor /
    per-row FP8 GEMM with cuBLASLt's fast accumulation, as TransformerEngine does); the dgrad
    and wgrad GEMMs run the ``"training"`` ones. With ``r.exact_emulation`` all three run the
    ``"exact"`` ones (:func:`jaxmx.matmul`'s).

    ``like``: for the wgrad GEMM, an array laid out like the weight, from which a partitioned
    GEMM's result takes its sharding (:func:`~jaxmx._src.gemm.gathered.gathered_gemm`).
    """
    chosen = kernels(
        Gemm(
            formats=(a.fmt, b.fmt),
            tiles=(getattr(a, "tile", None), getattr(b, "tile", None)),
            backend=r.backend,
            accumulation=r.accumulation,
            scale_mode=r.scale_mode,
            to_values=True,
        )
    )
    role = "exact" if r.exact_emulation else "forward" if forward else "training"
    if len(chosen) == 1 and _gathers_8bit(kernel := chosen["default"]):
        a, b = (_inside(r, q, kernel) for q in (a, b))
        return gathered_gemm(kernel, a, b, out_dtype, role, like)

    def operand(kernel: Kernel, q):
        if isinstance(q, MXArray):
            return q
        return quantized(
            q.x,
            q.key,
            fmt=q.fmt,
            axis=q.axis,
            scale_mode=r.scale_mode,
            to_values=kernel.takes_values,
        )

    return execute(chosen, a, b, out_dtype, role=role, accumulation=r.accumulation, prepare=operand)


def _gathers_8bit(kernel: Kernel) -> bool:
    """Whether the GEMM runs as :func:`~jaxmx._src.gemm.gathered.gathered_gemm`: a kernel
    whose SPMD form gathers 8-bit operands (``Kernel.gathers_8bit``), outside ``shard_map``
    (whose arrays are already per-device)."""
    return kernel.gathers_8bit and not jax.sharding.get_abstract_mesh().manual_axes


def _inside(r: Recipe, q: Operand | MXArray, kernel: Kernel):
    """An operand of :func:`gathered_gemm`: an MXArray as it is, an :class:`Operand` as a
    :class:`Quantized` one where each shard can quantize its own part, else quantized here (to
    element values for a kernel that takes them: a GridArray crosses devices as codes only
    where it is gathered)."""
    if isinstance(q, MXArray):
        return q
    if quantized_inside(q.fmt, q.key):
        return Quantized(q.x, q.fmt, q.x.ndim + q.axis, r.scale_mode)
    settings = dict(fmt=q.fmt, axis=q.axis, scale_mode=r.scale_mode)
    return quantized(q.x, q.key, **settings, to_values=kernel.takes_values)


def fprop(static: Static, x, w):
    """The forward GEMM of ``x`` [B, M, K] and ``w`` (high precision, or the tiled weight) as
    remat policies see a stock ``lax.dot_general``: the kernels as one opaque equation (no inner
    dot of theirs is saved), the result ``static.out_shape`` through a dot with the stock
    GEMM's batch dimensions and output dtype (:mod:`jaxmx._src.training.remat`)."""
    r = static.recipe

    def forward(x, w):
        along_k = weight_axes(static)[0]
        rhs = w if isinstance(w, MXArray) else Operand(x=w, fmt=r.fwd, axis=along_k)
        lhs = x if isinstance(x, MXArray) else Operand(x=x, fmt=r.fwd, axis=-1)
        return gemm(r, lhs, rhs, static.out_dtype, forward=True)

    y = opaque(forward, x, w).reshape(static.out_shape)
    # The barrier keeps the reshape from [B, M, N] where it is: XLA's reshape mover would
    # otherwise sink it through the caller's elementwise chain one op per simplification pass
    # (a GELU's took the MXFP8 demo step's passes to XLA's limit of 25; docs/benchmarks.md).
    return lax.optimization_barrier(presented_as_dot(y, static.n_batch))


def named(q: MXArray, name: str) -> MXBits:
    """``q`` as saved for the backward pass: its arrays as bits (:func:`as_bits`, so that
    ``lax.scan`` stacks them in place), named ``name`` for remat policies."""
    return jax.tree.map(lambda a: checkpoint_name(a, name), as_bits(q))


def named_input(x: jax.Array, name: str) -> jax.Array:
    """A high-precision input as saved for the backward pass (``Recipe.residuals=
    "high_precision"``): its bits (:func:`~jaxmx._src.core.dtypes.to_bits`), named ``name``."""
    return checkpoint_name(to_bits(x), name)


def vma_like(ct, primal):
    """``ct`` varying over the same ``shard_map`` axes as ``primal`` (what autodiff does itself).

    Inside ``shard_map``, the cotangent of an operand that is the same on every device (e.g.
    replicated weights in data parallelism) is summed over the axes along which the gradient
    varies; an operand that varies where the cotangent does not gets it broadcast (``pcast``).
    Outside ``shard_map`` both sets are empty.
    """
    want, have = varying_axes(jax.tree.leaves(primal)[0]), varying_axes(ct)
    extra = tuple(sorted(have - want))
    if extra:
        ct = lax.psum(ct, extra)
    missing = tuple(sorted(want - have))
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    return ct


def observed(
    static: Static, lhs: Operand, rhs: Operand, default_name: str = "dot_general"
) -> tuple[Static, object]:
    """Reports the forward GEMM's two operands, as it quantizes them, to the active observer
    (:func:`~jaxmx._src.training.scope.observe`, under ``default_name`` outside any
    ``named`` block): returns ``static`` carrying the observer's backward hook and the tap
    value the custom VJP takes as an extra input, or ``static`` and ``None`` when nothing
    observes the backward legs."""
    r = static.recipe
    tap = scope.observe(r, _leg(lhs, r), _leg(rhs, r), default_name)
    if tap is None:
        return static, None
    return dataclasses.replace(static, observe_grad=tap.backward), tap.value


def observed_gradient(static: Static, dgrad: Operand, wgrad: Operand):
    """The tap's cotangent: the observer's record of the output gradient's two copies as the
    backward GEMMs quantize them (``None`` when nothing observes)."""
    if static.observe_grad is None:
        return None
    return static.observe_grad(_leg(dgrad, static.recipe), _leg(wgrad, static.recipe))


def _leg(q: Operand, r: Recipe) -> scope.Leg:
    return scope.Leg(q.x, q.fmt, q.axis, r.scale_mode)
