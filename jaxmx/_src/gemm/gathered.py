"""The emulated training GEMMs under SPMD: sharded operands gathered as 8-bit codes and scales.

The emulation is plain JAX; left to XLA, a GEMM operand sharded along a dimension the GEMM needs
whole (an FSDP weight sharded along N) is gathered wherever propagation puts the reshard,
typically the float32 element values or the high-precision weight. :func:`gathered_gemm` runs
the emulated GEMM inside a ``custom_partitioning`` rule instead. The rule takes the operands
with their propagated shardings, chooses the GEMM's shardings with the native GEMM's plan
(:func:`~jaxmx._src.gemm.partitioning.plan`: batch, then lhs rows M, then rhs rows N, then K each
take a mesh axis once) and, for each dimension of an operand that the plan un-shards:

- a high-precision operand (quantized inside, 1-D blocks along its K) is quantized on its own
  device (blocks are whole inside a shard) and its codes and scales are ``all_gather`` ed as
  ``uint8``; an operand that stays sharded is quantized straight to element values as on one
  device (a kernel that ``takes_values``);
- an MXArray (a residual copy, a tiled or per-tensor weight) has its codes and scales gathered as
  ``uint8`` (FP4 codes two per byte; float32 scales as they are: one per row or tensor, and
  NVFP4's tensor scale);
- a GridArray (an operand quantized outside the rule straight to element values: NVFP4's, or
  one rounded stochastically) is taken as it is where it is not gathered; where it is, its
  values are encoded to their codes (exactly) and gathered as an MXArray's are.

Propagation (Shardy, the rule's factors): the result's rows follow the lhs rows (M) and the rhs
rows (N), but N is declared a permutation factor, which Shardy's op-priority propagation moves
only after the pass-through factors. So where one mesh axis shards both (FSDP: the batch and the
weight's rows), the result takes the lhs's sharding, as the plan does, and N still reaches the
result where its axis is free (tensor parallelism). A weight-gradient GEMM is given ``like``, an
array of the result's shape laid out like the weight (its saved copy's codes, never read or
moved): its result takes the weight's sharding from it and not from the operands, whose rows
would otherwise carry the weight's sharding back into the output gradient (an all-to-all of
float32 values, then a gather of the other operand along the batch).

A dimension whose shards would cut a block, or that does not divide into equal shards, is left
to XLA (it reshards the operand as given, high precision for a high-precision operand) with one
warning naming the operand and the axis. On one device the rule runs the per-device function as
is.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.gemm.emulate import EMULATE_VALUES
    >>> from jaxmx._src.gemm.gathered import Quantized, gathered_gemm
    >>> a = Quantized(jnp.ones((1, 2, 64)), "mxfp8_e4m3", 2, "floor")
    >>> gathered_gemm(EMULATE_VALUES, a, a, jnp.float32).tolist()
    [[[64.0, 64.0], [64.0, 64.0]]]
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx._src.core import wire
from jaxmx._src.core.block_sharding import BlockShardingError, mesh_axes, spec_of
from jaxmx._src.core.exportable import exportable
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.grid_array import GridArray
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.gemm.batching import vmappable
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.gemm.partitioning import plan, reduced
from jaxmx._src.quantize.codec import decode_elements, encode
from jaxmx._src.quantize.fake import quantize_to_grid
from jaxmx._src.quantize.quantize import quantize

_WHERE = "jaxmx.dot_general"


class Quantized(NamedTuple):
    """A high-precision operand ``x`` [B, rows, K] (``axis`` 2) or [B, K, rows] (``axis`` 1),
    quantized inside the GEMM in 1-D blocks of ``fmt`` along ``axis``."""

    x: jax.Array
    fmt: str
    axis: int
    scale_mode: str


class _Side(NamedTuple):  # the static description of one operand
    kind: str  # "hp" (a Quantized operand), "mx" (an MXArray) or "grid" (a GridArray)
    fmt: str
    axis: int
    scale_mode: str | None
    shape: tuple[int, ...]  # the logical shape
    tile: tuple[int, int] | None
    dtypes: tuple[jnp.dtype, ...]  # of its leaves, as they were before travelling
    scale_batch: tuple[int, ...] = ()  # an MXArray's scale's own batch dims

    @property
    def k_first(self) -> bool:
        return self.axis == len(self.shape) - 2


def quantized_inside(fmt: str, key) -> bool:
    """Whether an operand of ``fmt`` (with a rounding ``key`` or None) may be quantized inside
    the rule, on its own shard: 1-D blocks, whose quantization a shard holding whole blocks
    reproduces; per-tensor and per-row scales, NVFP4's tensor scale, and random bits depend on
    the whole tensor."""
    f = get_format(fmt)
    return f.span == "block" and not f.has_global_scale and key is None


def gathered_gemm(kernel: Kernel, a, b, out_dtype, role: str = "training", like=None) -> jax.Array:
    """The emulated GEMM ``kernel`` (a :class:`~jaxmx._src.gemm.kernels.Kernel` that
    ``gathers_8bit``) of ``a`` and ``b`` (each a :class:`Quantized` operand, an MXArray or, for
    a kernel that ``takes_values``, a GridArray, with one leading batch dim), partitioned so
    that a gathered operand crosses devices as 8-bit codes and scales; ``role``: the kernel's
    runner it partitions (:data:`~jaxmx._src.gemm.kernels.ROLES`).

    ``like``: for a weight-gradient GEMM, an array laid out like the weight whose shape is the
    result's; the result's sharding propagates from it alone (see the module docstring). One of
    another shape (codes padded to whole blocks) is not used."""
    leaves, sides = [], []
    for op in (a, b):
        if isinstance(op, Quantized):
            side = _Side("hp", op.fmt, op.axis, op.scale_mode, op.x.shape, None, (op.x.dtype,))
            arrays = (op.x,)
        else:
            # a per-tensor scale [1, 1, 1] travels broadcast over the batch dims, like its codes,
            # and so does an NVFP4 tensor scale (a scalar per stacked tensor) as [..., 1, 1]
            batch = op.data.shape[:-2]
            scale = jnp.broadcast_to(op.scale, (*batch, *op.scale.shape[-2:]))
            arrays = (op.data, scale)
            if op.global_scale is not None:
                g = op.global_scale.reshape(op.global_scale.shape + (1,) * len(op.shape))
                arrays += (jnp.broadcast_to(g, (*batch, 1, 1)),)
            dtypes = tuple(x.dtype for x in arrays)
            kind = "grid" if isinstance(op, GridArray) else "mx"
            tile = None if kind == "grid" else op.tile
            side = _Side(kind, op.fmt, op.axis, None, op.shape, tile, dtypes, op.scale.shape[:-2])
            arrays = tuple(wire.to_wire(x) for x in arrays)
        sides.append(side)
        leaves.append(arrays)
    rows = tuple(s.shape[-1] if s.k_first else s.shape[-2] for s in sides)
    if like is not None and like.shape != (*sides[0].shape[:-2], *rows):
        like = None
    liked = like is not None
    op = _partitioned(kernel, jnp.dtype(out_dtype), tuple(sides), len(leaves[0]), role, liked)
    return op(*leaves[0], *leaves[1], *((like,) if liked else ()))


@functools.cache
def _partitioned(
    kernel: Kernel, out_dtype, sides: tuple[_Side, _Side], na: int, role: str, liked: bool
):
    run = kernel.runner(role)

    def operand(side: _Side, arrays, gathers):
        axis = side.axis - len(side.shape)
        if side.kind == "hp":
            (x,) = arrays
            if gathers is None or not any(gathers[0]):
                quantizer = quantize_to_grid if kernel.takes_values else quantize
                return quantizer(x, side.fmt, axis=axis, scale_mode=side.scale_mode)
            q = quantize(x, side.fmt, axis=axis, scale_mode=side.scale_mode)
            data, scale = (_gather(t, gathers[0]) for t in (q.data, q.scale))
            shape = tuple(s * _count(g) for s, g in zip(x.shape, gathers[0], strict=True))
            return MXArray(data, scale, side.fmt, q.axis, shape)
        data, scale, *tensor_scale = (
            wire.from_wire(t, d) for t, d in zip(arrays, side.dtypes, strict=True)
        )
        if gathers is not None and any(map(any, gathers)):
            grid = side.kind == "grid"  # a GridArray crosses devices as its codes, exactly
            if grid:
                data = encode(data, get_format(side.fmt), on_grid=True)
            data, scale, *tensor_scale = (
                _gather(t, g) for t, g in zip((data, scale, *tensor_scale), gathers, strict=True)
            )
            if grid:
                data = decode_elements(data, get_format(side.fmt))
        nd = len(side.shape)
        for i, n in enumerate(side.scale_batch):  # undo the broadcasts
            if n == 1:
                scale = lax.slice_in_dim(scale, 0, 1, axis=scale.ndim - nd + i)
        g = tensor_scale[0][(..., *(0,) * nd)] if tensor_scale else None
        rows_k = tuple(min(a, b) for a, b in zip(data.shape[-2:], side.shape[-2:], strict=True))
        shape = (*data.shape[data.ndim - nd : -2], *rows_k)
        if side.kind == "grid":
            return GridArray(data, scale, side.fmt, side.axis, shape, g)
        return MXArray(data, scale, side.fmt, side.axis, shape, side.tile, g)

    def operands(args):  # all but ``like``, which only steers propagation
        return args[:-1] if liked else args

    def local(args, gathers, dtype):
        args = operands(args)
        a_gathers, b_gathers = (None, None) if gathers is None else (gathers[:na], gathers[na:])
        a = operand(sides[0], args[:na], a_gathers)
        b = operand(sides[1], args[na:], b_gathers)
        return run(a, b, dtype, None)

    @custom_partitioning
    def gemm(*args):
        return local(args, None, out_dtype)

    def partition(mesh, arg_shapes, result_shape):
        p, shardings, gathers = _layout(mesh, operands(arg_shapes), result_shape, sides, na)
        if liked:  # taken as it is: it is not read
            shardings = (*shardings, arg_shapes[-1].sharding)

        def lower(*args):
            return reduced(p, lambda dtype: local(args, gathers, dtype), out_dtype)

        return mesh, lower, p.result_sharding, shardings

    def infer(mesh, arg_shapes, result_shape):
        return _layout(mesh, operands(arg_shapes), result_shape, sides, na)[0].result_sharding

    gemm.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_rule(sides, liked),
        permutation_factors=("n",),
        decode_shardings=False,
    )
    plain = exportable(gemm, lambda *args: local(args, None, out_dtype), _WHERE)
    return jax.jit(vmappable(plain, fold=None))


def _count(axes_sizes) -> int:
    return math.prod(n for _, n in axes_sizes) if axes_sizes else 1


def _gather(x, gathers):
    """``x`` all-gathered (tiled) along each dim over the mesh axes ``gathers[dim]`` names."""
    for dim, axes in enumerate(gathers):
        if axes:
            x = all_gathered(x, tuple(a for a, _ in axes), dim)
    return x


def all_gathered(x, axis_name, axis: int):
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)``, ``x`` crossing in its wire form
    (:func:`~jaxmx._src.core.wire.to_wire`; 4-bit codes with an even last dim two per byte)."""
    sent = wire.to_wire(x)
    if sent.dtype != jnp.uint4 or sent.shape[-1] % 2:
        out = lax.all_gather(sent, axis_name, axis=axis, tiled=True)
    else:  # whole pairs on every shard: the gathered pairs are the pairs of the gathered codes
        packed = lax.all_gather(wire.pack_nibbles(sent), axis_name, axis=axis, tiled=True)
        out = wire.unpack_nibbles(packed)
    return wire.from_wire(out, x.dtype)


def _rule(sides, liked: bool) -> str:
    """The Shardy rule: the batch dims (``...``) are shared; the result's rows factors ``m`` and
    ``n`` are those of each operand's first array, or with ``liked`` those of the last operand
    (``like``) alone; every other dim has a factor of its own, so each operand arrives with its
    own propagated sharding and the partition callback decides. (``n`` is declared a
    permutation factor in :func:`_partitioned`: see the module docstring.)"""
    specs, count = [], iter(range(1000))
    for i, side in enumerate(sides):
        for j, _ in enumerate(side.dtypes):
            pair = [f"f{next(count)}", f"f{next(count)}"]
            if j == 0 and not liked:
                pair[1 if side.k_first else 0] = "mn"[i]
            specs.append("... " + " ".join(pair))
    if liked:
        specs.append("... m n")
    return ", ".join(specs) + " -> ... m n"


def _layout(mesh, arg_shapes, result_shape, sides, na):
    """(the GEMM's plan, the shardings the rule takes its arrays in, and per array and dim the
    ``(mesh axis, size)`` pairs to gather on the device)."""
    k_first = tuple(s.k_first for s in sides)
    block = get_format(sides[0].fmt).block
    shapes, problems = (arg_shapes[0], arg_shapes[na]), []
    try:
        p = plan(mesh, shapes, result_shape, _WHERE, block, k_first)
    except BlockShardingError as e:  # K whole on each device instead: XLA gathers it
        problems.append(f"{e} The emulated GEMM gathers K instead.")
        p = plan(mesh, shapes, result_shape, _WHERE, block, k_first, split_k=False)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    shardings, gathers = [], []
    for i, side in enumerate(sides):
        want_spec = tuple(p.arg_shardings[i].spec)
        for j in range(len(side.dtypes)):
            shape = arg_shapes[(0, na)[i] + j]
            nd = len(shape.shape)
            try:
                have = spec_of(shape, mesh, _WHERE, block)
            except BlockShardingError:  # split into mesh sub-axes: left to XLA
                have = (None,) * nd
            padded = want_spec + (None,) * (nd - len(want_spec))
            want = [mesh_axes(e) if n > 1 else () for e, n in zip(padded, shape.shape, strict=True)]
            used = {a for w in want for a in w}
            spec, gather = [], []
            for d in range(nd):
                h = tuple(a for a in mesh_axes(have[d]) if a not in used)
                if want[d] or not h:
                    spec.append(want[d] or None)
                    gather.append(())
                    continue
                n = math.prod(sizes[a] for a in h)
                problem = _problem(side, d - nd, shape.shape[d], n, block)
                if problem:
                    problems.append(
                        f"{_WHERE}: the {('lhs', 'rhs')[i]} operand {tuple(shape.shape)} of an "
                        f"emulated GEMM is sharded along its dim {d} over mesh axes {h}, "
                        f"{problem}; XLA gathers it in high precision instead of as 8-bit "
                        f"codes. Make that dim's per-shard size a multiple of {block} to gather "
                        "8-bit codes."
                    )
                    spec.append(None)
                    gather.append(())
                    continue
                used.update(h)
                spec.append(h)
                gather.append(tuple((a, sizes[a]) for a in h))
            shardings.append(NamedSharding(mesh, P(*spec)))
            gathers.append(tuple(gather))
    if problems:  # one warning per GEMM
        warnings.warn(" ".join(dict.fromkeys(problems)), stacklevel=2)
    return p, tuple(shardings), tuple(gathers)


def _problem(side: _Side, d: int, size: int, n: int, block: int) -> str | None:
    """Why dim ``d`` (negative) of an operand's array cannot be gathered on the device, or None."""
    if size % n:
        return f"which does not split into {n} equal shards"
    if side.kind == "hp" and d == side.axis - len(side.shape) and (size // n) % block:
        return f"whose {size // n}-element shards would cut its {block}-element blocks"
    return None
