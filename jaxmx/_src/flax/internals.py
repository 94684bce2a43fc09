"""The Flax internals that jaxmx relies on, each behind one function (pinned by
tests/test_flax_internals.py, so that a Flax release that removes or changes one fails there,
by name, rather than somewhere downstream).

Checked with Flax 0.12.8.

Example:
    >>> from flax import nnx
    >>> linen_module_path() is None                   # no linen module is being called
    True
    >>> nnx_dot_general_cls(nnx.Linear(2, 3, rngs=nnx.Rngs(0))) is None
    True
"""

from __future__ import annotations

from typing import Any

from flax.linen import module as linen_module


def linen_module_path() -> str | None:
    """The ``/``-joined path of the linen module being called (the innermost one), or ``None``
    outside any linen call (or at the root module, whose path is empty).

    Why: :class:`jaxmx.flax.MXDotGeneral` names its GEMMs after the layer that calls it (for
    :func:`jaxmx.diagnostics.telemetry`), and linen's call stack has no public accessor. This
    reads the private ``flax.linen.module._context.module_stack`` (a list of the modules being
    called, innermost last) and the module's ``scope.path``. Checked with Flax 0.12.8; should
    Flax drop them, this returns ``None`` (the GEMMs keep their default names), and
    tests/test_flax_internals.py fails.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> class Outer(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return Inner(name="inner")(x)
        >>> class Inner(nn.Module):
        ...     def __call__(self, x):
        ...         print(linen_module_path())
        ...         return x
        >>> _ = Outer().init(jax.random.key(0), jnp.ones(2))
        inner
    """
    stack = getattr(getattr(linen_module, "_context", None), "module_stack", None)
    module = stack[-1] if stack else None
    scope = getattr(module, "scope", None)
    return "/".join(scope.path) if scope is not None and scope.path else None


def linen_rng_streams(module: Any) -> tuple[str, ...]:
    """The names of the PRNG streams a bound linen module's call was given (``"params"`` while
    initializing, ``"dropout"`` ...).

    Why: ``jaxmx.flax.linen.quantize_model`` plans a conversion by running the module's method
    abstractly on a copy, which needs keys for the same streams; Flax has no public accessor
    for the stream names. This reads ``module.scope.rngs`` (a dict keyed by stream name in
    ``flax.core.scope.Scope``). Checked with Flax 0.12.8.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> class Probe(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         print(linen_rng_streams(self))
        ...         return x
        >>> _ = Probe().init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, 1.0)
        ('params', 'dropout')
    """
    return tuple(module.scope.rngs)


def nnx_dot_general_cls(layer: Any) -> Any:
    """The ``dot_general_cls`` of an nnx layer: a factory that Flax calls for the layer's GEMM
    *instead of* its ``dot_general``, or ``None`` (unset, or a layer type without one).

    Why: ``nnx.quantize_model`` replaces a layer's ``dot_general``, which Flax ignores when
    ``dot_general_cls`` is set, so such layers are refused. Flax 0.12.8 has the attribute on
    ``nnx.LinearGeneral`` only (not ``nnx.Linear``), hence the ``getattr`` with a default.

    Example:
        >>> from flax import nnx
        >>> layer = nnx.LinearGeneral(4, 8, dot_general_cls=lambda: None, rngs=nnx.Rngs(0))
        >>> nnx_dot_general_cls(layer) is not None
        True
    """
    return getattr(layer, "dot_general_cls", None)
