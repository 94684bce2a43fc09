"""``jaxmx.expert_parallel_ffn``: a mixture-of-experts FFN with its experts sharded over a mesh
axis, whose dispatch all-to-all sends the tokens in 8 bits.

Called inside ``jax.shard_map`` over the expert axis, with the tokens (batch x sequence
flattened) sharded over the same axis. Each device holds ``t`` tokens and ``e`` experts
(``E = n e`` over the ``n`` devices of the axis; expert ``i`` lives on device ``i // e``):

1. Route: each token's ``k`` assignments (the caller's expert ids and gate weights) take the
   next free slot of their expert; each device has ``capacity`` slots per expert, filled in the
   order of its tokens (then of the ``k`` choices). Assignments past the capacity are dropped:
   they add nothing to the output, and their number over the axis is returned (a 4-byte
   all-reduce).
2. Dispatch: the ``[E capacity, d]`` send buffer is quantized rowwise along ``d`` in
   ``recipe.fwd`` (whole blocks per token: a token's codes do not depend on the other tokens),
   and its codes and scales cross the all-to-all as ``uint8`` (XLA:CPU would widen 8-bit floats
   to float32 on the wire): 1 + 1/32 bytes per element for MXFP8, the empty slots included (the
   zero codes that pad ``d`` to whole blocks stay home).
3. Experts: the received codes feed the first grouped GEMM as they are
   (:func:`jaxmx.ragged_dot` of an MXArray: no decode and requantization), then
   ``activation``, then the second grouped GEMM (:func:`jaxmx.ragged_dot`, its input quantized
   as usual).
4. Combine: the experts' outputs travel back in high precision (``x.dtype``), as in
   DeepSeek-V3, and each token sums its assignments times their gate weights.

Gradients: the backward of the dispatch sends the input gradient back in high precision (the
carrier of :func:`jaxmx._src.training.ragged.quantized_ragged_dot`), the backward of the combine
too (the transpose of an all-to-all is one), and the expert GEMMs run ragged_dot's quantized
VJP; the weight gradient of the first GEMM quantizes the received tokens columnwise from their
decoded 8-bit values (DeepSeek-V3's requantization).

There is no ``lax.ragged_all_to_all``: XLA:CPU does not implement it (jax 0.10.2), and a fixed
capacity keeps every shape static.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("expert",))
    >>> x, w_in, w_out = jnp.ones((4, 32)), jnp.ones((2, 32, 8)), jnp.ones((2, 8, 32))
    >>> ids, gates = jnp.array([[0], [1], [1], [0]]), jnp.ones((4, 1))
    >>> ffn = lambda *a: jaxmx.expert_parallel_ffn(
    ...     *a, axis_name="expert", capacity=2, activation=lambda h: h)
    >>> layer = jax.shard_map(ffn, mesh=mesh, in_specs=P("expert"),
    ...     out_specs=(P("expert"), P()))
    >>> args = jax.device_put((x, ids, gates, w_in, w_out), jax.NamedSharding(mesh, P("expert")))
    >>> y, dropped = jax.jit(layer)(*args)
    >>> y[0, 0].item(), dropped.item()
    (256.0, 0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import wire
from jaxmx._src.core.checks import check_key
from jaxmx._src.core.dtypes import as_array, as_float_array
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.core.sizes import round_up
from jaxmx._src.core.support import lacks
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.training.grouped import grouped_recipe
from jaxmx._src.training.ragged import quantized_ragged_dot, ragged_dot

_WHERE = "jaxmx.expert_parallel_ffn"


def expert_parallel_ffn(
    x: jax.Array,
    expert_ids: jax.Array,
    gates: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    axis_name: str,
    capacity: int,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    recipe: Recipe | None = MXFP8,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The FFN ``activation(x @ w_in[i]) @ w_out[i]`` of each token's experts ``i``, weighted by
    their gates and summed, with the experts sharded over ``axis_name`` (see the module
    docstring). Call it inside ``jax.shard_map`` over ``axis_name``; the shapes are per device.

    Args:
        x: ``[t, d]`` float tokens of this device.
        expert_ids: ``[t, k]`` integers in ``[0, E)``: each token's experts (the router's top-k,
            the caller's); an id outside it is dropped and counted as such.
        gates: ``[t, k]`` float weights of those experts.
        w_in: ``[e, d, h]``: this device's ``e`` experts (global ids ``axis_index * e + j``).
        w_out: ``[e, h', d]``, with ``activation`` mapping ``[rows, h]`` to ``[rows, h']``
            row by row (elementwise, or a gated unit splitting ``h``) and zero rows to zeros.
        axis_name: the mesh axis the experts and the tokens are sharded over.
        capacity: slots per expert on each device (static): the dispatch sends
            ``E capacity`` rows per device whatever the routing.
        activation: between the two GEMMs (default GELU).
        recipe: the expert GEMMs' :class:`jaxmx.Recipe` (as :func:`jaxmx.grouped_recipe` runs
            it), whose ``fwd`` format quantizes the dispatched tokens (its codes must be 8-bit
            and it must have no tensor scale: MX FP8, MXFP6, MXINT8, block FP8); ``None``: no
            quantization anywhere (the tokens travel in ``x.dtype``, ``lax.ragged_dot``).
        key: for ``recipe.grad_rounding == "stochastic"`` (split between the two GEMMs).

    Returns:
        ``(y, dropped)``: ``y [t, d]`` in ``x.dtype``, and the number of assignments dropped
        over all devices of the axis (an int32 scalar, the same on every device: ``P()``).
    """
    x = as_float_array(x, f"{_WHERE}: x")
    gates = as_float_array(gates, f"{_WHERE}: gates")
    expert_ids = as_array(expert_ids, f"{_WHERE}: expert_ids")
    w_in = as_float_array(w_in, f"{_WHERE}: w_in")
    w_out = as_float_array(w_out, f"{_WHERE}: w_out")
    if check_recipe(recipe, _WHERE, optional=True) is not None:
        recipe = grouped_recipe(recipe)
        _check_wire_format(recipe.fwd)
    n = lax.axis_size(axis_name)
    e, d = w_in.shape[0], x.shape[-1]
    _check_shapes(x, expert_ids, gates, w_in, w_out, capacity)
    t, k = expert_ids.shape

    slot, counts, dropped = _route(expert_ids, n * e, capacity)
    dropped = lax.psum(dropped, axis_name)
    send = jnp.zeros((n * e * capacity, d), x.dtype).at[slot].set(jnp.repeat(x, k, 0), mode="drop")

    # 2. dispatch; the receiver lays each expert's tokens out one after the other
    received = lax.all_to_all(counts.reshape(n, e), axis_name, 0, 0)  # [source, e]
    order, inverse, group_sizes = _layout(received, capacity)
    if recipe is None:
        tokens = _per_expert(lax.all_to_all(_by_device(send, n), axis_name, 0, 0), order)
        hidden = lax.ragged_dot(tokens, w_in, group_sizes, preferred_element_type=x.dtype)
        out = lax.ragged_dot(activation(hidden), w_out, group_sizes, preferred_element_type=x.dtype)
    else:  # 3. the experts read the received codes as they are
        codes, scales, carrier = _dispatch(recipe, axis_name, _by_device(send, n))
        q = _received(recipe.fwd, _per_expert(codes, order), _per_expert(scales, order), d)
        keys = (None, None) if key is None else tuple(jax.random.split(check_key(key, _WHERE)))
        hidden = quantized_ragged_dot(
            q, _per_expert(carrier, order), w_in, group_sizes, recipe=recipe, key=keys[0]
        )
        out = ragged_dot(
            activation(hidden),
            w_out,
            group_sizes,
            recipe=recipe,
            key=keys[1],
            preferred_element_type=x.dtype,
        )

    # 4. combine in high precision, back to the assignments' slots
    back = lax.all_to_all(_by_device(out[inverse], n), axis_name, 0, 0).reshape(-1, d)
    y = jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(t, k, d)
    y = (y * gates[..., None].astype(y.dtype)).sum(1)
    return y.astype(x.dtype), dropped


def _route(expert_ids: jax.Array, num_experts: int, capacity: int):
    """(each assignment's slot in the send buffer, ``expert * capacity + rank``, or
    ``num_experts * capacity`` when dropped; the filled slots per expert; the number dropped).
    Assignments take their expert's slots in token order, then choice order."""
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    onehot = ids[:, None] == jnp.arange(num_experts, dtype=jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0, dtype=jnp.int32), ids[:, None], 1)
    keep = (rank[:, 0] <= capacity) & (ids >= 0) & (ids < num_experts)
    slot = jnp.where(keep, ids * capacity + rank[:, 0] - 1, num_experts * capacity)
    counts = jnp.minimum(onehot.sum(0, dtype=jnp.int32), capacity)
    return slot, counts, (ids.size - keep.sum()).astype(jnp.int32)


def _received(fmt: str, codes: jax.Array, scales: jax.Array, d: int) -> MXArray:
    """The MXArray ``[rows, d]`` of the received ``uint8`` codes (``d`` of them per row) and
    scales; the codes that pad the last block, zeros, are restored here."""
    f = get_format(fmt)
    codes = jnp.pad(codes, ((0, 0), (0, round_up(d, f.block) - d)))
    data, scale = wire.from_wire(codes, f.dtype), wire.from_wire(scales, f.scale_dtype)
    return MXArray(data, scale, fmt, 1, (codes.shape[0], d))


def _check_shapes(x, expert_ids, gates, w_in, w_out, capacity) -> None:
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{_WHERE}: x must be [t, d] and expert_ids [t, k], got x {list(x.shape)} and "
            f"expert_ids {list(expert_ids.shape)}"
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"{_WHERE}: expert_ids must be integers, got {expert_ids.dtype}")
    if gates.shape != expert_ids.shape:
        raise ValueError(
            f"{_WHERE}: gates must have expert_ids' shape {list(expert_ids.shape)}, got "
            f"{list(gates.shape)}"
        )
    if w_in.ndim != 3 or w_in.shape[1] != x.shape[1]:
        raise ValueError(
            f"{_WHERE}: w_in must be [e, d, h] with d = {x.shape[1]}, got {list(w_in.shape)}"
        )
    if w_out.ndim != 3 or w_out.shape[0] != w_in.shape[0] or w_out.shape[2] != x.shape[1]:
        raise ValueError(
            f"{_WHERE}: w_out must be [e, h', d] = [{w_in.shape[0]}, h', {x.shape[1]}], got "
            f"{list(w_out.shape)}"
        )
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{_WHERE}: capacity must be a positive int, got {capacity!r}")


def _check_wire_format(fmt: str) -> None:
    """A NotImplementedError for formats the dispatch cannot send (:mod:`~jaxmx._src.core.support`:
    codes that are not whole bytes; a tensor scale, where one per device would differ from one
    device's)."""
    if missing := lacks(get_format(fmt), "expert_dispatch"):
        raise NotImplementedError(f"{_WHERE}: the dispatch sends 8-bit codes; {fmt} has {missing}")


def _by_device(rows: jax.Array, n: int) -> jax.Array:
    """``[n m, ...]`` rows as ``[n, m, ...]``: the all-to-all's split axis."""
    return rows.reshape(n, rows.shape[0] // n, *rows.shape[1:])


def _layout(received: jax.Array, capacity: int):
    """(the permutation that lays each expert's received tokens out one after the other, its
    inverse, the group sizes). The receive buffer is ``[source, e, capacity]`` rows, the first
    ``received[source, j]`` slots of each ``(source, j)`` filled; the permutation orders rows by
    expert, then source, then slot, filled ones first (the single-device order of the tokens)."""
    n, e = received.shape
    filled = jnp.arange(capacity) < received.T[:, :, None]  # [e, source, capacity]
    by_expert = jnp.arange(n * e * capacity).reshape(n, e, capacity).swapaxes(0, 1)
    group_sizes = received.sum(0)
    expert = jnp.broadcast_to(jnp.arange(e)[:, None, None], filled.shape)
    # filled rows of expert j first, in order; the empty ones (zeros) after all groups
    sort_key = jnp.where(filled, expert, e).reshape(-1)
    order = by_expert.reshape(-1)[jnp.argsort(sort_key, stable=True)]
    return order, jnp.argsort(order), group_sizes


def _per_expert(received: jax.Array, order: jax.Array) -> jax.Array:
    """The ``[source, e capacity, ...]`` receive buffer's rows in ``order``."""
    return received.reshape(-1, *received.shape[2:])[order]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch(recipe: Recipe, axis_name: str, send: jax.Array):
    """(codes, scales, carrier): ``send [n, m, d]`` quantized along ``d`` and exchanged as
    ``uint8``; ``carrier`` (zeros ``[n, m, d]``) takes the received tokens' gradient, which
    the backward pass sends back in ``send``'s dtype."""
    q = quantize(send, recipe.fwd, axis=2, scale_mode=recipe.scale_mode)
    d = send.shape[2]  # the codes past it pad the last block: zeros, not sent
    codes = lax.all_to_all(wire.to_wire(q.data[..., :d]), axis_name, 0, 0)
    scales = lax.all_to_all(wire.to_wire(q.scale, all_bytes=True), axis_name, 0, 0)
    return codes, scales, jnp.zeros_like(send)


def _dispatch_fwd(recipe: Recipe, axis_name: str, send: jax.Array):
    return _dispatch(recipe, axis_name, send), None


def _dispatch_bwd(recipe: Recipe, axis_name: str, _, cotangents):
    _, _, carrier = cotangents
    return (lax.all_to_all(carrier, axis_name, 0, 0),)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
