"""The Flax internals behind jaxmx._src.flax.internals still exist and still mean what jaxmx
reads from them (a failure here names the Flax internal that changed)."""

import inspect

import jax
import jax.numpy as jnp
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
linen_module = pytest.importorskip("flax.linen.module")

from jaxmx._src.flax.internals import (  # noqa: E402
    linen_module_path,
    linen_rng_streams,
    nnx_dot_general_cls,
)


def test_linen_call_stack_is_readable():
    context = getattr(linen_module, "_context", None)
    assert hasattr(context, "module_stack"), (
        "flax.linen.module._context.module_stack is gone: linen_module_path cannot find the "
        "calling module (MXDotGeneral's telemetry names fall back to the defaults)"
    )
    seen = []

    class Inner(nn.Module):
        def __call__(self, x):
            seen.append(linen_module_path())
            return x

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Inner(name="inner")(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(name="block_0")(x)

    Model().init(jax.random.key(0), jnp.ones(2))
    assert seen == ["block_0/inner"], (
        f"linen_module_path() read {seen} inside block_0/inner: the module stack of "
        "flax.linen.module._context or Module.scope.path changed meaning"
    )
    assert linen_module_path() is None  # outside any call


def test_linen_rng_stream_names_are_readable():
    seen = []

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen.append(linen_rng_streams(self))
            return nn.Dropout(0.5, deterministic=False)(x)

    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = Probe().init(rngs, jnp.ones(2))
    Probe().apply(variables, jnp.ones(2), rngs={"dropout": jax.random.key(2)})
    assert seen == [("params", "dropout"), ("dropout",)], (
        f"linen_rng_streams read {seen}: Module.scope.rngs is no longer a dict keyed by the "
        "stream names the call was given (linen quantize_model's abstract pass needs them)"
    )


def test_nnx_dot_general_cls_is_a_linear_general_attribute():
    params = inspect.signature(nnx.LinearGeneral.__init__).parameters
    assert "dot_general_cls" in params, (
        "nnx.LinearGeneral no longer takes dot_general_cls: nnx_dot_general_cls and "
        "quantize_model's refusal of such layers need another look"
    )

    def factory():
        return jax.lax.dot_general

    layer = nnx.LinearGeneral(4, 8, dot_general_cls=factory, rngs=nnx.Rngs(0))
    assert nnx_dot_general_cls(layer) is factory, (
        "nnx.LinearGeneral(dot_general_cls=f) no longer keeps f as layer.dot_general_cls"
    )
    assert nnx_dot_general_cls(nnx.LinearGeneral(4, 8, rngs=nnx.Rngs(0))) is None
    assert nnx_dot_general_cls(nnx.Linear(4, 8, rngs=nnx.Rngs(0))) is None
