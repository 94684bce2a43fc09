"""Adam and AdamW whose moments are stored in low precision (:mod:`moments`), as optax transforms.

:func:`scale_by_adam` is optax's ``scale_by_adam`` with each moment stored in a chosen format:
inside ``update`` the stored moments are decoded to float32, moved towards the gradient (``m +
(1 - b1) (g - m)``, ``v + (1 - b2) (g^2 - v)``), encoded again, and the float32 values give the
direction ``(m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)`` (the arithmetic of torchao's
low-bit Adam). :func:`adam` and :func:`adamw` wrap it as optax's do.

Example:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones((16, 512)), "b": jnp.zeros(512)}
    >>> tx = adamw(1e-3, state_format="8bit")
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> optax.apply_updates(params, updates)["w"].shape
    (16, 512)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmx._src.optim import moments


class ScaleByAdamState(NamedTuple):
    """The state of :func:`scale_by_adam`: the step count and each moment as a tuple of
    :class:`~moments.DenseMoment` / :class:`~moments.BlockMoment`, one per parameter in the
    order of ``jax.tree.leaves(params)``, each naming its parameter's path. (A flat tuple, not
    a copy of the parameters' tree: ``nnx.Optimizer`` keeps a tree's Variables, which would
    wrap each moment.)"""

    count: jax.Array
    mu: tuple
    nu: tuple


def param_name(path) -> str:
    """A parameter's path as text, without the ``.value`` of an nnx Variable."""
    return jax.tree_util.keystr(path).removesuffix(".value")


def _lerp(start: jax.Array, end: jax.Array, weight: float) -> jax.Array:
    """``start + weight (end - start)`` in float32, computed from the nearer end."""
    w = np.float32(weight)
    if abs(w) < 0.5:
        return start + w * (end - start)
    return end + (w - np.float32(1)) * (end - start)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    state_format: str = "8bit",
    mu_format: str | None = None,
    nu_format: str | None = None,
    block_size: int | None = None,
    min_size: int = 4096,
) -> optax.GradientTransformation:
    """Rescales updates by Adam's moments, stored in ``state_format``.

    Args:
        b1, b2, eps: as in ``optax.scale_by_adam``.
        state_format: the format of both moments, one of ``"float32"``, ``"bfloat16"``,
            ``"8bit"``, ``"fp8"``, ``"4bit"`` (docs/optimizers.md has their bytes and bounds).
        mu_format, nu_format: the first / second moment's format, if not ``state_format``.
        block_size: elements per scale of the block formats (default 256; 128 for ``"4bit"``).
        min_size: parameters with fewer elements keep block-format moments in float32.

    The updates are float32. A parameter whose moments stay float32 in place of a block format
    is listed by :func:`~jaxmx.optim.state_report`; one of at least ``min_size`` elements that
    does not divide into blocks also warns at ``init``. A sharded parameter must hold whole
    blocks per device (else ``init`` raises ``BlockShardingError`` naming it and the fix).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = scale_by_adam(state_format="bfloat16")
        >>> tx.init({"w": jnp.ones((4, 4))}).mu[0].values.dtype
        dtype(bfloat16)
    """
    formats = {
        "mu": moments.check_format(mu_format or state_format, "mu_format" * bool(mu_format)),
        "nu": moments.check_format(nu_format or state_format, "nu_format" * bool(nu_format)),
    }
    if block_size is not None and (block_size < 2 or block_size % 2):
        raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
    blocks = {k: block_size or moments.DEFAULT_BLOCKS.get(f, 256) for k, f in formats.items()}

    def init_fn(params):
        def init_one(path, p, key):
            fmt, block = formats[key], blocks[key]
            name = param_name(path)
            note = moments.dense_note(tuple(p.shape), block, min_size)
            if key == "mu" and fmt in moments.BLOCK_FORMATS and note and p.size >= min_size:
                warnings.warn(
                    f"optimizer state of {name} (shape {tuple(p.shape)}) stays float32: {note}; "
                    "pad it to a multiple of the block or pass a block_size that divides it",
                    stacklevel=3,
                )
            return moments.zeros(
                p, fmt, signed=key == "mu", block=block, min_size=min_size, name=name
            )

        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        mu = tuple(init_one(path, p, "mu") for path, p in leaves)
        nu = tuple(init_one(path, p, "nu") for path, p in leaves)
        return ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        if len(leaves) != len(state.mu):
            raise ValueError(
                f"scale_by_adam: {len(leaves)} updates for a state of {len(state.mu)} parameters"
            )
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        correction1 = 1 - jnp.float32(b1) ** t
        correction2 = 1 - jnp.float32(b2) ** t
        directions, mu, nu = [], [], []
        for g, stored_m, stored_v in zip(leaves, state.mu, state.nu, strict=True):
            g = g.astype(jnp.float32)
            m = _lerp(moments.decode(stored_m), g, 1 - b1)
            v = _lerp(moments.decode(stored_v), g * g, 1 - b2)
            directions.append((m / correction1) / (jnp.sqrt(v) / jnp.sqrt(correction2) + eps))
            mu.append(moments.encode(m, stored_m))
            nu.append(moments.encode(v, stored_v))
        return treedef.unflatten(directions), ScaleByAdamState(count, tuple(mu), tuple(nu))

    return optax.GradientTransformation(init_fn, update_fn)


def adam(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    state_format: str = "8bit",
    mu_format: str | None = None,
    nu_format: str | None = None,
    block_size: int | None = None,
    min_size: int = 4096,
) -> optax.GradientTransformation:
    """Adam (``optax.adam``) with its moments stored in ``state_format``
    (:func:`scale_by_adam`); ``learning_rate`` a float or an optax schedule.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adam(1e-3, state_format="4bit")
        >>> tx.init({"w": jnp.ones((64, 128))})[0].mu[0].codes.shape
        (64, 64)
    """
    return optax.chain(
        scale_by_adam(
            b1,
            b2,
            eps,
            state_format=state_format,
            mu_format=mu_format,
            nu_format=nu_format,
            block_size=block_size,
            min_size=min_size,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    state_format: str = "8bit",
    mu_format: str | None = None,
    nu_format: str | None = None,
    block_size: int | None = None,
    min_size: int = 4096,
) -> optax.GradientTransformation:
    """AdamW (``optax.adamw``: decoupled weight decay, ``mask`` as there) with its moments stored
    in ``state_format`` (:func:`scale_by_adam`).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adamw(1e-3, weight_decay=0.1, state_format="fp8")
        >>> tx.init({"w": jnp.ones((16, 256))})[0].mu[0].codes.dtype
        dtype(float8_e4m3fn)
    """
    return optax.chain(
        scale_by_adam(
            b1,
            b2,
            eps,
            state_format=state_format,
            mu_format=mu_format,
            nu_format=nu_format,
            block_size=block_size,
            min_size=min_size,
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
