"""The Flax adapters of jaxmx.KVCache: nnx init_kv_cache and linen kv_cache, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kv_cache import _reference_attention

import jaxmx

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
import jaxmx.flax.linen as mxl  # noqa: E402
import jaxmx.flax.nnx as mxnnx  # noqa: E402

FEATURES, STEPS = 64, 4  # 2 heads of 32: one MX block each
X = np.asarray(jax.random.normal(jax.random.key(0), (2, STEPS, FEATURES)))


def _want(q, k, v, out):
    """Per step i: out(attention of q_i over k, v[:i + 1]) with the numpy reference."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    return [
        np.asarray(out(jnp.asarray(_reference_attention(
            q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], i + 1, True, "mxfp8_e4m3"
        ), jnp.float32)))
        for i in range(STEPS)
    ]  # fmt: skip


def test_nnx_decodes_over_an_mx_cache_under_jit():
    layer = nnx.MultiHeadAttention(
        2, FEATURES, num_kv_heads=1, decode=True, rngs=nnx.Rngs(0)
    )  # head_dim 32, GQA
    assert mxnnx.init_kv_cache(layer, 2, 8) == ["."]
    assert isinstance(layer.kv_cache.get_value(), jaxmx.KVCache) and layer.cached_key is None
    x = jnp.asarray(X)
    q, k, v = layer.query(x), layer.key(x), layer.value(x)
    traces = []

    @nnx.jit
    def step(layer, x):
        traces.append(1)
        return layer(x)

    got = [np.asarray(step(layer, x[:, i : i + 1])) for i in range(STEPS)]
    assert len(traces) == 1 and int(layer.cache_index[...]) == STEPS
    for g, w in zip(got, _want(q, k, v, layer.out), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    # a prefill chunk then one token: the same as token by token
    mxnnx.init_kv_cache(layer, 2, 8)
    step(layer, x[:, :3])
    np.testing.assert_allclose(np.asarray(step(layer, x[:, 3:])), got[3], rtol=2e-5, atol=2e-5)


def test_nnx_refuses_what_the_mx_cache_cannot_do():
    with pytest.raises(ValueError, match=r"no nnx\.MultiHeadAttention"):
        mxnnx.init_kv_cache(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 1, 8)
    layer = nnx.MultiHeadAttention(2, FEATURES, decode=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown fmt 'int8'"):
        mxnnx.init_kv_cache(layer, 1, 8, fmt="int8")
    mxnnx.init_kv_cache(layer, 1, 8)
    with pytest.raises(ValueError, match="decode takes no mask"):
        layer(jnp.ones((1, 1, FEATURES)), mask=jnp.ones((1, 1, 1, 8), bool))


def test_linen_decodes_over_an_mx_cache_with_the_stock_parameters():
    layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    x = jnp.asarray(X)
    stock = layer.init(jax.random.key(0), jnp.zeros((2, 8, FEATURES)))
    with mxl.kv_cache():
        variables = layer.init(jax.random.key(0), jnp.zeros((2, 8, FEATURES)))
        step = jax.jit(lambda v, x: layer.apply(v, x, mutable=["cache"]))
        got = []
        for i in range(STEPS):
            y, state = step(variables, x[:, i : i + 1])
            variables = {**variables, **state}
            got.append(np.asarray(y))
    assert jax.tree.structure(stock["params"]) == jax.tree.structure(variables["params"])
    assert isinstance(variables["cache"]["kv_cache"], jaxmx.KVCache)
    assert int(variables["cache"]["cache_index"]) == STEPS
    p = variables["params"]

    def dense(name, x):
        return jnp.einsum("btf,fhd->bthd", x, p[name]["kernel"]) + p[name]["bias"]

    def out(a):
        return jnp.einsum("bthd,hdf->btf", a, p["out"]["kernel"]) + p["out"]["bias"]

    want = _want(dense("query", x), dense("key", x), dense("value", x), out)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_linen_refuses_a_mask_and_unknown_formats():
    layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    with pytest.raises(ValueError, match="unknown fmt 'int8'"), mxl.kv_cache(fmt="int8"):
        pass
    with mxl.kv_cache():
        variables = layer.init(jax.random.key(0), jnp.zeros((1, 8, FEATURES)))
        with pytest.raises(ValueError, match="decode takes no mask"):
            layer.apply(variables, jnp.ones((1, 1, FEATURES)), mask=jnp.ones((1, 2, 1, 8), bool),
                        mutable=["cache"])  # fmt: skip


def test_nnx_names_nested_layers_by_path():
    class Model(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([nnx.MultiHeadAttention(2, FEATURES, rngs=nnx.Rngs(0))])

    assert mxnnx.init_kv_cache(Model(), 1, 8) == ["blocks/0"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mutable", [True, False], ids=["mutable", "immutable"])
def test_linen_apply_outside_the_context_says_so(mutable, jit):
    layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    with mxl.kv_cache():
        variables = layer.init(jax.random.key(0), jnp.zeros((1, 8, FEATURES)))
    kwargs = {"mutable": ["cache"]} if mutable else {}

    def apply(v, x):
        return layer.apply(v, x, **kwargs)

    apply = jax.jit(apply) if jit else apply
    with pytest.raises(ValueError, match=r"decodes over a jaxmx.KVCache .* outside `with jaxmx"):
        apply(variables, jnp.ones((1, 1, FEATURES)))


def test_linen_apply_inside_the_context_over_a_stock_init_says_so():
    layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    variables = layer.init(jax.random.key(0), jnp.zeros((1, 8, FEATURES)))
    with mxl.kv_cache(), pytest.raises(ValueError, match=r"top-level layer has no jaxmx.KVCache"):
        layer.apply(variables, jnp.ones((1, 1, FEATURES)), mutable=["cache"])
