"""FSDP weight gathers of the emulated training GEMMs move 8-bit codes and scales, never f32/bf16.

A two-GEMM MLP, weights sharded on their first dim (N) over the data axis, jax.grad of the step:
the all-gathered bytes per weight element, by HLO dtype (jaxmx.diagnostics.collective_bytes), and
the loss and gradients against the single-device step, within the bound :func:`gemm_bound`
derives from docs/native.md's.
"""

import warnings

import bounds
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx._src.core.dtypes import to_bits
from jaxmx._src.quantize.local_quantize import local_quantize
from jaxmx.diagnostics import collective_bytes

DIMS = (((1,), (1,)), ((), ()))
RECIPES = ("MXFP8", "MXFP8_2D", "FP8_TENSORWISE", "FP8_ROWWISE", "MXFP4", "NVFP4")


def _recipe(name):
    if name in ("MXFP4", "NVFP4"):  # nearest rounding: no key to thread through the test
        return jaxmx.recipes.MXFP4.replace(grad_rounding="nearest")
    return getattr(jaxmx.recipes, name)


N, K, M = 512, 256, 256  # w1 [N, K], w2 [K, N]


def _mm(recipe):
    def mm(x, w):
        if recipe is None:
            return lax_dot(x, w)
        return jaxmx.dot_general(x, w, DIMS, recipe=recipe, preferred_element_type=jnp.float32)

    return mm


def _loss(recipe):
    """sum(y * c) of y = relu(x @ w1.T) @ w2.T: the output gradient is the input ``c``, so every
    tensor that gets quantized (x, w1, w2, h, c, the gradient at the pre-activation) comes out of
    a reduction that no layout splits, and only the results differ by summation order."""
    mm = _mm(recipe)

    def loss(p, xc):
        x, c = xc
        h = jax.nn.relu(mm(x, p["w1"]))
        return jnp.sum(mm(h, p["w2"]) * c)

    return loss


def gemm_bound(a, b, want):
    """How far two runs of the GEMM ``want = q(a) @ q(b).T`` (contracting the last axis, K) may
    differ: twice docs/native.md's bound (tests/bounds.py) with ``sum_k |q(a)_k q(b)_k|``
    bounded from the operands before quantization, ``4 ||a_m|| ||b_n||`` (2-norms over K): every
    quantization here rounds to nearest on a float grid that holds 0 (and saturates), so
    ``|q(v)| <= 2 |v|``; a random Hadamard transform along K keeps the 2-norm; Cauchy-Schwarz.
    The factor ``1 + 2^-16`` covers the float32 rounding of the decode and of the rotation."""
    a, b = (np.asarray(v, np.float64) for v in (a, b))
    norms = np.outer(np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1))
    abs_sum = 4 * (1 + 2.0**-16) * norms
    return bounds.between(abs_sum, a.shape[-1], np.asarray(want, np.float64))


def sum_bound(terms, roundings=1):
    """Twice the float32 accumulation bound of a sum of ``terms`` (each rounded ``roundings``
    times) computed twice in different orders from the same terms."""
    terms = np.abs(np.asarray(terms, np.float64))
    return 2 * bounds.accumulation(terms.sum(), terms.size, roundings)


def step_bounds(recipe, p, xc, want):
    """The bound of each result of the MLP step (:func:`_loss`) between two layouts: each weight
    gradient's GEMM (:func:`gemm_bound` of its operands, the one-device intermediates), and the
    loss, a float32 sum of the products y * c (:func:`sum_bound`) whose y may differ by its own
    GEMM's bound."""
    mm, (x, c) = _mm(recipe), jax.device_put(xc, jax.devices()[0])
    x = x.astype(jnp.float32)
    pre = mm(x, p["w1"])
    y, pullback = jax.vjp(lambda h: mm(h, p["w2"]), jax.nn.relu(pre))
    h, dpre = jax.nn.relu(pre), jnp.where(pre > 0, pullback(c)[0], 0.0)
    grads = want[1]
    return {
        "loss": sum_bound(y * c) + float((np.abs(c) * gemm_bound(h, p["w2"], y)).sum()),
        "w1": gemm_bound(dpre.T, x.T, grads["w1"]),
        "w2": gemm_bound(c.T, h.T, grads["w2"]),
    }


def lax_dot(x, w):
    return jax.lax.dot_general(x, w.astype(jnp.bfloat16), DIMS, preferred_element_type=jnp.float32)


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    p = {
        "w1": jax.random.normal(k[0], (N, K)) * 0.05,
        "w2": jax.random.normal(k[1], (K, N)) * 0.05,
    }
    x = jax.random.normal(k[2], (M, K)).astype(jnp.bfloat16)
    c = jax.random.normal(k[3], (M, K))  # the output gradient
    return p, (x, c)


def _mesh(layout, explicit):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * 2
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=types)


def _specs(layout):
    if layout == "fsdp":  # FSDP over all 8 devices
        return {"w1": P(("data", "model"), None), "w2": P(("data", "model"), None)}, P(
            ("data", "model"), None
        )
    # FSDP over "data" x tensor parallel over "model": w1 column-, w2 row-parallel
    return {"w1": P("model", "data"), "w2": P("data", "model")}, P("data", None)


def _step(recipe_name, layout, explicit):
    recipe = None if recipe_name == "bf16" else _recipe(recipe_name)
    mesh = _mesh(layout, explicit)
    wspec, xspec = _specs(layout)
    p, x = _inputs()
    p = {k: jax.device_put(v, NamedSharding(mesh, wspec[k])) for k, v in p.items()}
    x = jax.device_put(x, (NamedSharding(mesh, xspec),) * 2)
    step = jax.jit(jax.value_and_grad(_loss(recipe)))
    return step, p, x, mesh


@pytest.fixture(scope="module")
def single():
    p, x = _inputs()
    out = {}
    for name in RECIPES:
        cpu0 = jax.devices()[0]
        pp, xx = jax.device_put((p, x), cpu0)
        want = jax.jit(jax.value_and_grad(_loss(_recipe(name))))(pp, xx)
        out[name] = want, step_bounds(_recipe(name), pp, xx, want)
    return out


CASES = [(r, lay, e) for r in RECIPES for lay in ("fsdp", "fsdp_tp") for e in (False, True)]


@pytest.mark.parametrize("recipe,layout,explicit", CASES)
def test_gathers_are_8bit_and_match_one_device(recipe, layout, explicit, single):
    step, p, x, _ = _step(recipe, layout, explicit)
    compiled = step.lower(p, x).compile()
    loss, grads = compiled(p, x)
    b = collective_bytes(compiled)
    high = sum(b.of("all-gather", t) for t in ("f32", "bf16"))
    weight_elems = 2 * N * K
    # no weight crosses in high precision (float32 per-row scales are 4 bytes per 256 elements)
    assert high < 0.02 * weight_elems, (recipe, layout, b)
    # three 8-bit planes gathered: w1's forward copy, w2's forward and dgrad copies (grad is
    # taken of the weights only: no dgrad of w1), each 1 byte per element (FP4 codes two per
    # byte: half of it) plus its scales (1/32 byte for 1-D 32-element blocks, ~0 for 2-D tiles
    # and per-row / per-tensor scales); under fsdp_tp each device gathers over "data" only, half
    # a weight. Nothing else is gathered, Auto axes included: no activation.
    r = _recipe(recipe)
    f = jaxmx.FORMATS[r.fwd]
    one_d = f.span == "block" and not r.weight_tile
    code = 0.5 if ml_dtypes.finfo(f.dtype).bits == 4 else 1.0
    planes = 1.5 * (code + (1 / f.block if one_d else 0))
    planes *= 0.5 if layout == "fsdp_tp" else 1
    per_elem = b.of("all-gather", "u8") / weight_elems
    assert planes - 0.01 < per_elem < planes + 0.01, (per_elem, b)
    # the activations keep their batch sharding (no all-to-all between GEMMs), and each weight
    # gradient leaves reduce-scattered into its weight's layout
    assert b.of("all-to-all") == 0, b
    for k, sharding in compiled.output_shardings[1].items():
        assert sharding.is_equivalent_to(p[k].sharding, 2), (k, sharding, p[k].sharding)
    (want_loss, want_grads), within = single[recipe]
    bounds.assert_within(loss, want_loss, within["loss"], "loss")
    for k in grads:
        bounds.assert_within(grads[k], want_grads[k], within[k], k)


def test_stock_bf16_gathers_high_precision():
    """The reference: the stock step all-gathers its weights in float32 on XLA:CPU."""
    step, p, x, _ = _step("bf16", "fsdp", False)
    b = collective_bytes(step.lower(p, x).compile())
    assert b.of("all-gather", "f32") >= 4 * N * K


def test_scan_and_remat_match_one_device():
    recipe = jaxmx.recipes.MXFP8
    policy = jax.checkpoint_policies.save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)

    def layer(h, w):
        y = jaxmx.dot_general(h, w, DIMS, recipe=recipe, preferred_element_type=jnp.float32)
        return jax.nn.relu(y), None

    def loss(ws, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
        return jnp.mean(h**2)

    k = jax.random.split(jax.random.key(1), 2)
    ws = jax.random.normal(k[0], (2, K, K)) * 0.1
    x = jax.random.normal(k[1], (M, K))
    want = jax.jit(jax.value_and_grad(loss))(*jax.device_put((ws, x), jax.devices()[0]))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    ws_s = jax.device_put(ws, NamedSharding(mesh, P(None, "fsdp", None)))
    x_s = jax.device_put(x, NamedSharding(mesh, P("fsdp", None)))
    compiled = jax.jit(jax.value_and_grad(loss)).lower(ws_s, x_s).compile()
    got = compiled(ws_s, x_s)
    b = collective_bytes(compiled)
    assert b.of("all-gather", "f32") + b.of("all-gather", "bf16") < 0.02 * ws.size, b
    assert b.of("all-gather", "u8") > 0
    # the weights are gathered, so each layer's output (and its gradient, 2 h / size at the
    # last) comes out of an unsplit reduction; the loss and the weight gradients (sums over the
    # sharded batch) differ by their summation order only
    mm = _mm(recipe)
    pre1 = mm(x, ws[0])
    h1 = jax.nn.relu(pre1)
    h2 = jax.nn.relu(mm(h1, ws[1]))
    g2 = 2 * h2 / h2.size
    dh1 = jax.vjp(lambda h: mm(h, ws[1]), h1)[1](g2)[0]
    g1 = jnp.where(pre1 > 0, dh1, 0.0)
    bounds.assert_within(got[0], want[0], sum_bound(h2**2 / h2.size, 2), "loss")
    bounds.assert_within(got[1][0], want[1][0], gemm_bound(g1.T, x.T, want[1][0]), "dw0")
    bounds.assert_within(got[1][1], want[1][1], gemm_bound(g2.T, h1.T, want[1][1]), "dw1")


def test_misaligned_shards_warn_and_match_one_device():
    """A weight [N=64, K=128] sharded on K over 8 devices (16 per shard): its forward copy
    cannot be gathered as codes; XLA gathers it in high precision, with one warning."""
    recipe = jaxmx.recipes.MXFP8
    k = jax.random.split(jax.random.key(2), 2)
    w = jax.random.normal(k[0], (64, 128))
    x = jax.random.normal(k[1], (64, 128))

    def f(x, w):
        return jnp.sum(jaxmx.dot_general(x, w, DIMS, recipe=recipe) ** 2)

    want = jax.jit(f)(x, w)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    x_s = jax.device_put(x, NamedSharding(mesh, P("fsdp", None)))
    w_s = jax.device_put(w, NamedSharding(mesh, P(None, "fsdp")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jit(f)(x_s, w_s)
    messages = [str(c.message) for c in caught if "8-bit codes" in str(c.message)]
    assert messages and "'fsdp'" in messages[0] and "multiple of 32" in messages[0]
    # y comes out of the gathered weight whole; only the sum of its squares is split
    y = jaxmx.dot_general(x, w, DIMS, recipe=recipe)
    bounds.assert_within(got, want, sum_bound(y**2))


def test_nvfp4_tensor_scales_span_the_shards():
    """NVFP4 operands quantized inside the GEMMs (no weight tiles, nearest rounding): each
    tensor scale is the whole tensor's, not a shard's; x's rows are scaled so that one shard
    holds the tensor's amax. The step equals one device and gathers no float32."""
    recipe = jaxmx.Recipe(fwd="nvfp4", grad="nvfp4", scale_mode="e4m3", grad_rounding="nearest")
    k = jax.random.split(jax.random.key(3), 2)
    w = jax.random.normal(k[0], (N, K)) * 0.05
    x = jax.random.normal(k[1], (M, K)).at[: M // 8].multiply(100.0)

    def loss(w, x):
        y = jaxmx.dot_general(x, w, DIMS, recipe=recipe, preferred_element_type=jnp.float32)
        return jnp.mean(y**2)

    want = jax.jit(jax.value_and_grad(loss))(*jax.device_put((w, x), jax.devices()[0]))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    w_s = jax.device_put(w, NamedSharding(mesh, P("fsdp", None)))
    x_s = jax.device_put(x, NamedSharding(mesh, P("fsdp", None)))
    compiled = jax.jit(jax.value_and_grad(loss)).lower(w_s, x_s).compile()
    got = compiled(w_s, x_s)
    b = collective_bytes(compiled)
    assert b.of("all-gather", "f32") + b.of("all-gather", "bf16") < 0.02 * w.size, b
    assert b.of("all-gather", "u8") > 0, b
    # w is gathered, so y and its gradient 2 y / size come out of unsplit reductions; the loss
    # and dw (a sum over the sharded rows) differ by summation order
    y = jaxmx.dot_general(x, w, DIMS, recipe=recipe, preferred_element_type=jnp.float32)
    bounds.assert_within(got[0], want[0], sum_bound(y**2 / y.size, 2), "loss")
    bounds.assert_within(got[1], want[1], gemm_bound((2 * y / y.size).T, x.T, want[1]), "dw")


def test_nvfp4_weight_tiles_quantized_where_the_shards_live():
    """NVFP4 16x16 weight tiles of a weight sharded along both dims: each device quantizes its
    own tiles with the whole weight's tensor scale (one reduced scalar amax); codes, scales and
    tensor scale equal one device's, bit for bit, and no float32 tile is gathered."""
    w = jax.random.normal(jax.random.key(4), (1, 128, 64)).at[0, :16].multiply(50.0)
    want = jaxmx.quantize(w, "nvfp4", tile=(16, 16))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    w_s = jax.device_put(w, NamedSharding(mesh, P(None, "data", "model")))
    fn = jax.jit(lambda w: local_quantize(w, "nvfp4", "e4m3", (16, 16)))
    compiled = fn.lower(w_s).compile()
    got = compiled(w_s)
    b = collective_bytes(compiled)
    # no float32 tiles cross: only the (replicated) outputs' scales, a few dozen bytes
    assert b.of("all-gather", "f32") == 0 and b.of("all-gather") < 0.01 * w.size, b
    for leaf in ("data", "scale", "global_scale"):
        np.testing.assert_array_equal(
            to_bits(getattr(got, leaf)), to_bits(getattr(want, leaf)), err_msg=leaf
        )


def test_vmapped_nvfp4_weight_tiles_have_a_tensor_scale_each():
    w = jax.random.normal(jax.random.key(5), (3, 1, 32, 32)).at[1].multiply(30.0)
    got = jax.vmap(lambda w: local_quantize(w, "nvfp4", "e4m3", (16, 16)))(w)
    for i in range(3):
        want = jaxmx.quantize(w[i], "nvfp4", tile=(16, 16))
        for leaf in ("data", "scale", "global_scale"):
            np.testing.assert_array_equal(
                to_bits(getattr(got, leaf)[i]), to_bits(getattr(want, leaf)), err_msg=leaf
            )
