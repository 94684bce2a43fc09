"""bfloat16 master weights updated with stochastic rounding, as the last optax transform.

``optax.apply_updates`` adds a float32 update to a bfloat16 parameter and rounds the sum to
nearest, so updates smaller than half a bfloat16 step are lost. :func:`bf16_stochastic_round`
instead rounds ``p + u`` (float32) to one of its two neighbouring bfloat16 values, up (away from
zero) with probability equal to the dropped low 16 bits over ``2^16``, and returns the update that
lands ``apply_updates`` exactly on it. Other dtypes pass through.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(4096, jnp.bfloat16)}
    >>> tx = bf16_stochastic_round(0)
    >>> u, _ = tx.update({"w": jnp.full(4096, 2.0**-10)}, tx.init(params), params)
    >>> new = optax.apply_updates(params, u)["w"]   # 1 + 2^-10: an eighth of a bf16 step up
    >>> 0.1 < float((new > 1).mean()) < 0.15
    True
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class StochasticRoundState(NamedTuple):
    """The raw ``uint32`` data of the PRNG key of the next step."""

    key: jax.Array


def round_to_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to bfloat16: away from zero with probability (low 16 bits of
    ``x``) / 2^16, else towards zero."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    draw = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    up = jnp.where(draw < (bits & 0xFFFF), jnp.uint32(0x10000), jnp.uint32(0))
    rounded = jax.lax.bitcast_convert_type((bits & jnp.uint32(0xFFFF0000)) + up, jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def bf16_stochastic_round(seed: int | jax.Array = 0) -> optax.GradientTransformation:
    """The last transform of a chain for bfloat16 parameters: updates whose ``apply_updates``
    rounds each bfloat16 parameter stochastically (float32 updates; ``params`` required).

    Args:
        seed: an int or a PRNG key; each step folds in a fresh key.
    """

    def init_fn(params):
        del params
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        return StochasticRoundState(jax.random.key_data(key))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("bf16_stochastic_round needs params (pass them to update)")
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(step_key, max(len(leaves), 1))
        flat_params = treedef.flatten_up_to(params)
        out = []
        for u, p, k in zip(leaves, flat_params, keys, strict=True):
            if p.dtype != jnp.bfloat16:
                out.append(u)
                continue
            p32 = p.astype(jnp.float32)
            out.append(round_to_bf16(p32 + u.astype(jnp.float32), k).astype(jnp.float32) - p32)
        return treedef.unflatten(out), StochasticRoundState(jax.random.key_data(key))

    return optax.GradientTransformation(init_fn, update_fn)
