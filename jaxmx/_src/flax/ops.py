"""Picklable, hashable callables that bind a recipe to jaxmx's GEMMs, for Flax's layer hooks.

Flax stores the ``dot_general`` / ``einsum_op`` of a layer as a static attribute, so these are
frozen dataclasses: equal recipes give equal (and equally hashed) callables, which keeps ``jit``
caches and nnx graph definitions stable.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.recipes import MXFP8, Recipe
from jaxmx._src.flax.internals import linen_module_path
from jaxmx._src.training.attention import dot_product_attention as jaxmx_attention
from jaxmx._src.training.dot_general import dot_general as jaxmx_dot_general
from jaxmx._src.training.einsum import einsum as jaxmx_einsum
from jaxmx._src.training.ragged import ragged_dot as jaxmx_ragged_dot
from jaxmx._src.training.scope import named


@dataclasses.dataclass(frozen=True)
class MXDotGeneral:
    """``lax.dot_general``'s signature, computed by ``jaxmx.dot_general`` with ``recipe``.

    ``recipe=None`` calls ``lax.dot_general`` itself (high precision). Also accepts the
    ``out_sharding`` keyword that Flax passes (applied as a sharding constraint on the result).
    ``name`` names the GEMM in :func:`jaxmx.diagnostics.telemetry` (default: the calling linen
    module's path; ``quantize_model`` sets the layer path).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx.flax import MXDotGeneral
        >>> dg = MXDotGeneral()                     # jaxmx.recipes.MXFP8
        >>> dg(jnp.ones((4, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ()))).shape
        (4, 8)
    """

    recipe: Recipe | None = MXFP8
    name: str | None = None

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        if self.recipe is None:
            y = lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision,
                preferred_element_type=preferred_element_type,
            )
        else:
            with _named(self.name):
                y = jaxmx_dot_general(
                    lhs,
                    rhs,
                    dimension_numbers,
                    precision,
                    preferred_element_type,
                    recipe=self.recipe,
                )
        return _constrained(y, out_sharding)


@dataclasses.dataclass(frozen=True)
class MXEinsum:
    """Two-operand ``jnp.einsum`` computed by :func:`jaxmx.einsum` with ``recipe``.

    The ``einsum_op`` of ``nnx.Einsum``; ``recipe=None`` calls ``jnp.einsum`` itself. ``precision``
    is ignored under a recipe (the recipe fixes the products' precision), as in
    :func:`jaxmx.dot_general`. ``name``: as for :class:`MXDotGeneral`.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx.flax import MXEinsum
        >>> MXEinsum()("btd,hd->bth", jnp.ones((2, 4, 32)), jnp.ones((8, 32))).shape
        (2, 4, 8)
    """

    recipe: Recipe | None = MXFP8
    name: str | None = None

    def __call__(
        self,
        subscripts,
        lhs,
        rhs,
        *,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        if self.recipe is None:
            return jnp.einsum(
                subscripts,
                lhs,
                rhs,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )
        with _named(self.name):
            y = jaxmx_einsum(
                subscripts,
                lhs,
                rhs,
                preferred_element_type=preferred_element_type,
                recipe=self.recipe,
            )
        return _constrained(y, out_sharding)


@dataclasses.dataclass(frozen=True)
class MXAttention:
    """The ``attention_fn`` of Flax's attention layers, computed by
    :func:`jaxmx.dot_product_attention` (both attention products in MX formats).

    Takes Flax's ``dot_product_attention`` arguments: ``query [batch..., T, N, H]``,
    ``key`` / ``value [batch..., S, K, H]``, ``bias`` and ``mask`` broadcastable to
    ``[batch..., N, T, S]`` (a mask keeps its non-zero entries, as in Flax). ``dtype``,
    ``precision`` and ``module`` are accepted and ignored (the recipe fixes the products);
    attention-weight dropout is not supported and raises. ``name``: as for
    :class:`MXDotGeneral` (the two products are ``{name}/qk`` and ``{name}/pv``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxmx.flax import MXAttention
        >>> attn = nnx.MultiHeadAttention(4, 64, attention_fn=MXAttention(), decode=False,
        ...                               rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    recipe: Recipe | None = MXFP8
    name: str | None = None

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        is_causal=False,
        **unused,
    ) -> jax.Array:
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                "MXAttention: attention-weight dropout is not supported; set dropout_rate=0 or "
                "deterministic=True (dropout elsewhere in the model is unaffected)"
            )
        if mask is not None:
            mask = jnp.asarray(mask) != 0  # Flax's masks may be 0/1 floats (nn.make_causal_mask)
        if self.recipe is None:
            return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
        batch = query.shape[:-3]
        flat = [x.reshape(-1, *x.shape[-3:]) for x in (query, key, value)]
        heads = (query.shape[-2], query.shape[-3], key.shape[-3])  # N, T, S
        bias, mask = (
            None if x is None else jnp.broadcast_to(x, (*batch, *heads)).reshape(-1, *heads)
            for x in (bias, mask)
        )
        with _named(self.name):
            out = jaxmx_attention(*flat, bias, mask, is_causal=is_causal, recipe=self.recipe)
        return out.reshape(*batch, *out.shape[1:])


@dataclasses.dataclass(frozen=True)
class MXRaggedDot:
    """``lax.ragged_dot``'s signature, computed by :func:`jaxmx.ragged_dot` with ``recipe``: the
    grouped GEMM of a mixture-of-experts layer, held by the module that calls it.

    ``recipe=None`` calls ``lax.ragged_dot`` itself (high precision). ``name``: as for
    :class:`MXDotGeneral` (default: the calling linen module's path, else ``ragged_dot``).
    Stochastic rounding takes its key from an enclosing :func:`jaxmx.stochastic_rounding` block.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx.flax import MXRaggedDot
        >>> experts = MXRaggedDot()                 # jaxmx.recipes.MXFP8
        >>> lhs, rhs = jnp.ones((6, 32)), jnp.ones((2, 32, 8))
        >>> experts(lhs, rhs, jnp.array([2, 4])).shape
        (6, 8)
    """

    recipe: Recipe | None = MXFP8
    name: str | None = None

    def __call__(self, lhs, rhs, group_sizes, *, preferred_element_type=None) -> jax.Array:
        if self.recipe is None:
            return lax.ragged_dot(
                lhs, rhs, group_sizes, preferred_element_type=preferred_element_type
            )
        with _named(self.name):
            return jaxmx_ragged_dot(
                lhs,
                rhs,
                group_sizes,
                preferred_element_type=preferred_element_type,
                recipe=self.recipe,
            )


def ragged_dot_attributes(module) -> list[str]:
    """The names of the attributes of ``module`` (a linen or nnx module: dataclass fields, or set
    in ``setup`` / ``__init__``) that hold an :class:`MXRaggedDot`: where ``quantize_model``
    sets the conversion's recipe of a module of experts.

    Example:
        >>> class Experts:
        ...     def __init__(self):
        ...         self.up, self.down, self.width = MXRaggedDot(), MXRaggedDot(None), 64
        >>> ragged_dot_attributes(Experts())
        ['up', 'down']
    """
    return [name for name, value in vars(module).items() if isinstance(value, MXRaggedDot)]


def _constrained(y: jax.Array, out_sharding) -> jax.Array:
    """``y`` under the sharding constraint ``out_sharding`` that Flax passes (``None``: none)."""
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


@contextlib.contextmanager
def _named(name: str | None):
    """Telemetry names for the GEMMs in the block: ``name``, else the calling linen module's
    path, else none (the GEMMs keep their default names)."""
    name = name or linen_module_path()
    if name is None:
        yield
        return
    with named(name):
        yield
