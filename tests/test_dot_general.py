"""jaxmx.dot_general: the copy-per-GEMM table, accuracy per leg, transforms, residuals, errors.

Numerics are checked against the independent numpy + ml_dtypes reference of tests/reference.py
(quantize-dequantize in float64, rceil) and float64 GEMMs built from the copies of each GEMM.
"""

import functools

import bounds
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as mxref

import jaxmx
from jaxmx import LHS_COLWISE, RHS_COLWISE

EMULATE = jaxmx.recipes.MXFP8.replace(backend="emulate")
TN = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))


def ref_fake_quant(x, fmt="mxfp8_e4m3"):
    """Quantize-dequantize along the last axis with the numpy reference (rceil), in float64."""
    data, scale = mxref.quantize(np.asarray(x, np.float32), fmt, "rceil", axis=-1)
    return mxref.dequantize(data, scale, -1, np.shape(x))


def ref_dense_operands(x, w, g, fwd="mxfp8_e4m3", grad="mxfp8_e4m3"):
    """The decoded operands ``(a, b)`` (float64, TN: ``a @ b.T``) of y = x @ w.T and of its two
    gradient GEMMs, each from the copies of docs/training_gemm.md."""
    return (
        (ref_fake_quant(x, fwd), ref_fake_quant(w, fwd)),
        (ref_fake_quant(g, grad), ref_fake_quant(w.T, fwd)),  # g rowwise, w colwise [K, N]
        (ref_fake_quant(g.T, grad), ref_fake_quant(x.T, fwd)),  # g colwise, x colwise [K, M]
    )


def ref_dense_vjp(x, w, g, fwd="mxfp8_e4m3", grad="mxfp8_e4m3"):
    """y = x @ w.T and its gradients (dx, dw), exact products of :func:`ref_dense_operands`."""
    return tuple(a @ b.T for a, b in ref_dense_operands(x, w, g, fwd, grad))


def ref_gemm(a, b, out_dtype=jnp.float32):
    """``(a @ b.T, its bound)`` over the last axis of decoded operands ``[..., M, K]`` and
    ``[N, K]`` (tests/bounds.py)."""
    want = a @ b.T
    return want, bounds.against_exact(bounds.abs_products(a, b), a.shape[-1], want, out_dtype)


def summation_bound(a, b, out_dtype=jnp.float32):
    """docs/native.md's bound of a GEMM ``a @ b.T`` of decoded operands against its exact value:
    float32 accumulation over K plus the rounding to ``out_dtype`` (tests/bounds.py)."""
    return bounds.against_exact(bounds.abs_products(a, b), a.shape[-1], a @ b.T, out_dtype)


def outlier_inputs(m, k, n, seed=0):
    """Inputs whose rowwise and columnwise quantizations differ strongly."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    g = rng.standard_normal((m, n)).astype(np.float32)
    x[3] *= 1000.0  # an outlier row
    x[:, 5] *= 300.0  # an outlier column
    w[:, 7] *= 500.0
    g[:, 2] *= 1000.0
    g[4] *= 50.0
    return x, w, g


def vjp(f, x, w, g):
    y, pullback = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    return (np.asarray(y, np.float64), *(np.asarray(t, np.float64) for t in pullback(g)))


@pytest.mark.parametrize("recipe", [EMULATE, EMULATE.replace(grad="mxfp8_e5m2")])
@pytest.mark.parametrize("residuals", ["quantized", "high_precision"])
@pytest.mark.parametrize("w_k_first", [False, True])
def test_each_gemm_uses_its_own_copies(recipe, residuals, w_k_first):
    """y = x @ w.T with w stored [N, K] (TN) or [K, N] (a Flax kernel, quantized in place)."""
    recipe = recipe.replace(residuals=residuals)
    x, w, g = outlier_inputs(64, 96, 48)
    if w_k_first:
        dot = functools.partial(jaxmx.dot_general, dimension_numbers=NN, recipe=recipe)
        y, dx, dw_kn = vjp(jax.jit(lambda x, w_kn: dot(x, w_kn)), x, w.T, g)
        dw = dw_kn.T
    else:
        f = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=recipe)
        y, dx, dw = vjp(jax.jit(f), x, w, g)
    ry, rdx, rdw = ref_dense_vjp(x, w, g, recipe.fwd, recipe.grad)
    x_row, w_row = ref_fake_quant(x, recipe.fwd), ref_fake_quant(w, recipe.fwd)
    x_col, w_col = ref_fake_quant(x.T, recipe.fwd), ref_fake_quant(w.T, recipe.fwd)
    g_row, g_col = ref_fake_quant(g, recipe.grad), ref_fake_quant(g.T, recipe.grad)
    assert np.all(np.abs(y - ry) <= summation_bound(x_row, w_row))
    assert np.all(np.abs(dx - rdx) <= summation_bound(g_row, w_col))
    assert np.all(np.abs(dw - rdw) <= summation_bound(g_col, x_col))
    # A wrong copy (rowwise w in dgrad, rowwise x in wgrad, high-precision g) misses by far more.
    for wrong, right, bound in (
        (g_row @ w_row, rdx, summation_bound(g_row, w_col)),
        (g_col @ x_row, rdw, summation_bound(g_col, x_col)),
        (g @ w_col.T, rdx, summation_bound(g_row, w_col)),
        (g.T @ x_col.T, rdw, summation_bound(g_col, x_col)),
    ):
        assert np.any(np.abs(wrong - right) > 100 * bound)


def sqnr_db(approx, exact):
    return 10 * np.log10(np.sum(exact**2) / np.sum((approx - exact) ** 2))


@pytest.mark.parametrize("fmt, floor_db", [("mxfp8_e4m3", 28.0), ("mxfp8_e5m2", 22.0)])
def test_sqnr_per_leg_against_float64(fmt, floor_db):
    rng = np.random.default_rng(1)
    m, k, n = 128, 256, 192
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.normal(0, 1, (m, 1)))
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32) * 1e-3
    recipe = EMULATE.replace(fwd=fmt, grad=fmt)
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=recipe)
    y, dx, dw = vjp(f, x, w, g)
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    legs = {
        "fprop": sqnr_db(y, x64 @ w64.T),
        "dgrad": sqnr_db(dx, g64 @ w64),
        "wgrad": sqnr_db(dw, g64.T @ x64),
    }
    print(f"{fmt} SQNR dB: " + ", ".join(f"{leg} {v:.1f}" for leg, v in legs.items()))
    assert all(v > floor_db for v in legs.values()), legs
    assert all(v < 60 for v in legs.values()), legs  # it really is quantized


DIMENSION_CASES = [
    # (lhs shape, rhs shape, dimension numbers)
    ((5, 40), (7, 40), (((1,), (1,)), ((), ()))),
    ((40, 5), (7, 40), (((0,), (1,)), ((), ()))),
    ((5, 40), (40, 7), (((1,), (0,)), ((), ()))),
    ((2, 3, 64), (2, 64, 4), (((2,), (1,)), ((0,), (0,)))),
    ((3, 4, 16), (5, 4, 16), (((1, 2), (1, 2)), ((), ()))),
    ((4, 2, 33), (2, 6, 33), (((2,), (2,)), ((1,), (0,)))),
    ((1, 1, 32), (1, 3, 32), (((2,), (2,)), ((0,), (0,)))),
    ((1, 100), (1, 100), (((1,), (1,)), ((), ()))),
    ((6, 2, 3, 20), (3, 7, 20, 2), (((3, 1), (2, 3)), ((2,), (0,)))),
]


def ref_dot_general(lhs, rhs, dims):
    """The MX definition for general dimension numbers: canonicalize in numpy, quantize along K.
    Returns the exact product of the decoded operands and its bound (tests/bounds.py)."""
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(lhs.ndim) if d not in lc + lb]
    rf = [d for d in range(rhs.ndim) if d not in rc + rb]
    x = np.transpose(lhs, lb + tuple(lf) + lc)
    w = np.transpose(rhs, rb + tuple(rf) + rc)
    bshape = x.shape[: len(lb)]
    mshape, nshape = x.shape[len(lb) : len(lb) + len(lf)], w.shape[len(rb) : len(rb) + len(rf)]
    b, m, n = (int(np.prod(s)) for s in (bshape, mshape, nshape))
    xq = ref_fake_quant(x.reshape(b, m, -1))
    wq = ref_fake_quant(w.reshape(b, n, -1))
    want = np.einsum("bmk,bnk->bmn", xq, wq)
    bound = bounds.against_exact(bounds.abs_products(xq, wq), xq.shape[-1], want)
    shape = bshape + mshape + nshape
    return want.reshape(shape), bound.reshape(shape)


def ref_dot_general_grads(lhs, rhs, dims):
    """Gradients of sum(dot_general) from the copy-per-GEMM reference on canonical operands,
    each with the bound of its own GEMM (tests/bounds.py): ``((dlhs, bound), (drhs, bound))``."""
    (lc, rc), (lb, rb) = dims
    lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
    lperm, rperm = lb + lf + lc, rb + rf + rc
    x, w = np.transpose(lhs, lperm), np.transpose(rhs, rperm)
    b = int(np.prod(x.shape[: len(lb)]))
    m = int(np.prod(x.shape[len(lb) : len(lb) + len(lf)]))
    n = int(np.prod(w.shape[len(rb) : len(rb) + len(rf)]))
    x3, w3 = x.reshape(b, m, -1), w.reshape(b, n, -1)
    dx, dw = np.empty((2, *x3.shape)), np.empty((2, *w3.shape))
    for i in range(b):
        _, dgrad, wgrad = ref_dense_operands(x3[i], w3[i], np.ones((m, n), np.float32))
        for out, (a, c) in ((dx, dgrad), (dw, wgrad)):
            out[0, i] = a @ c.T
            out[1, i] = summation_bound(a, c)
    return tuple(
        tuple(np.transpose(v.reshape(t.shape), np.argsort(perm)) for v in d)
        for d, t, perm in ((dx, x, lperm), (dw, w, rperm))
    )


@pytest.mark.parametrize("lshape, rshape, dims", DIMENSION_CASES)
def test_general_dimension_numbers(lshape, rshape, dims):
    rng = np.random.default_rng(2)
    lhs = rng.standard_normal(lshape).astype(np.float32)
    rhs = rng.standard_normal(rshape).astype(np.float32)
    y = jax.jit(functools.partial(jaxmx.dot_general, dimension_numbers=dims, recipe=EMULATE))(
        lhs, rhs
    )
    expected = jax.lax.dot_general(lhs, rhs, dims)
    assert y.shape == expected.shape
    bounds.assert_within(y, *ref_dot_general(lhs, rhs, dims), "y")
    # the gradients of sum(y): each batch's canonical dense VJP, mapped back to the operands
    grads = jax.grad(lambda a, b: jaxmx.dot_general(a, b, dims, recipe=EMULATE).sum(), (0, 1))(
        jnp.asarray(lhs), jnp.asarray(rhs)
    )
    expected_grads = ref_dot_general_grads(lhs, rhs, dims)
    for got, (want, bound), what in zip(grads, expected_grads, ("dlhs", "drhs"), strict=True):
        bounds.assert_within(got, want, bound, what)


@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (1, 7, 3), (33, 65, 17), (128, 96, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_shapes_and_dtypes(m, k, n, dtype):
    x, w, g = outlier_inputs(max(m, 6), max(k, 8), max(n, 8), seed=m + k)
    x, w, g = x[:m, :k], w[:n, :k], g[:m, :n]
    x, w, g = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (x, w, g))
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=EMULATE)
    y, pullback = jax.vjp(f, jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    dx, dw = pullback(jnp.asarray(g, dtype))
    assert y.dtype == dx.dtype == dw.dtype == dtype
    legs = zip((y, dx, dw), ref_dense_operands(x, w, g), ("y", "dx", "dw"), strict=True)
    for out, (a, b), what in legs:
        bounds.assert_within(out, *ref_gemm(a, b, dtype), what)


def test_preferred_element_type_sets_output_dtype():
    x = jnp.ones((4, 32), jnp.bfloat16)
    y = jaxmx.dot_general(x, x, TN, preferred_element_type=jnp.float32, recipe=EMULATE)
    assert y.dtype == jnp.float32
    assert jaxmx.dot_general(x, x.astype(jnp.float32), TN, recipe=EMULATE).dtype == jnp.float32


def loss_fn(recipe):
    def loss(params, x):
        h = jaxmx.dot_general(x, params["w1"], TN, recipe=recipe)
        return jnp.sum(jaxmx.dot_general(jnp.tanh(h), params["w2"], TN, recipe=recipe) ** 2)

    return loss


def mlp_setup():
    k = jax.random.split(jax.random.key(3), 3)
    params = {
        "w1": jax.random.normal(k[0], (64, 48)) / 7,
        "w2": jax.random.normal(k[1], (16, 64)) / 8,
    }
    return params, jax.random.normal(k[2], (40, 48))


def layer_legs(recipe, w, g):
    """x -> (y, dx, dw) of y = x @ w.T through jaxmx.dot_general, cotangent ``g``."""

    def legs(x):
        y, pullback = jax.vjp(
            lambda x, w: jaxmx.dot_general(x, w, TN, recipe=recipe), x, jnp.asarray(w)
        )
        return (y, *pullback(jnp.asarray(g)))

    return legs


def assert_legs_within(got, want, x, w, g, i=None, fmts=("mxfp8_e4m3", "mxfp8_e4m3")):
    """Two runs of :func:`layer_legs` (``got[.][i]`` where ``i`` is given) agree within twice
    each leg's bound (tests/bounds.py), from the decoded operands of that leg's GEMM."""
    legs = zip(got, want, ref_dense_operands(x, w, g, *fmts), ("y", "dx", "dw"), strict=True)
    for a, b, (p, q), what in legs:
        a = a if i is None else a[i]
        tol = bounds.between(bounds.abs_products(p, q), p.shape[-1], b)
        bounds.assert_within(a, b, tol, what)


def test_transforms_jit_grad_value_and_grad_vmap_scan():
    params, x = mlp_setup()
    loss = loss_fn(EMULATE)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x)
    eager_grads = jax.grad(loss)(params, x[:40])
    jax.tree.map(np.testing.assert_array_equal, grads, eager_grads)
    assert np.isfinite(value)
    # vmap of a layer's forward and gradients == a loop, within the bound of each leg's GEMM
    # (one layer: a GEMM's rounding may flip a later quantization, which no GEMM bound covers)
    xl, wl, gl = outlier_inputs(40, 64, 48)
    xs = np.stack([xl, 2 * xl, -xl])
    mapped = jax.jit(jax.vmap(layer_legs(EMULATE, wl, gl)))(xs)
    for i in range(3):
        assert_legs_within(mapped, jax.jit(layer_legs(EMULATE, wl, gl))(xs[i]), xs[i], wl, gl, i)
    xs = jnp.stack([x, 2 * x, -x])

    # lax.scan over steps of plain SGD
    def step(p, xi):
        g = jax.grad(loss)(p, xi)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), loss(p, xi)

    _, losses = jax.jit(lambda p, xs: jax.lax.scan(step, p, xs))(params, xs)
    assert losses.shape == (3,) and np.all(np.isfinite(losses))


@pytest.mark.parametrize(
    "policy",
    [
        jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE),
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.everything_saveable,
    ],
)
def test_remat_policies_give_the_same_gradients(policy):
    params, x = mlp_setup()
    loss = loss_fn(EMULATE)
    expected = jax.grad(loss)(params, x)
    got = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(params, x)
    jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_residuals_are_named_for_remat(capsys):
    params, x = mlp_setup()
    policy = jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE)
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(loss_fn(EMULATE), policy=policy), params, x
    )
    saved = capsys.readouterr().out
    assert LHS_COLWISE in saved and RHS_COLWISE in saved


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantized_residuals_store_about_one_byte_per_element(dtype):
    m, k, n = 64, 256, 96
    x, w = jnp.ones((m, k), dtype), jnp.ones((n, k), dtype)
    f = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=EMULATE)
    _, pullback = jax.vjp(f, x, w)
    saved = sum(leaf.nbytes for leaf in jax.tree.leaves(pullback))
    elements = m * k + n * k
    assert saved <= 1.05 * elements  # fp8 codes + one E8M0 byte per 32
    assert saved >= elements
    hp = functools.partial(f, recipe=EMULATE.replace(residuals="high_precision"))
    _, pullback = jax.vjp(hp, x, w)
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(pullback)) >= elements * x.dtype.itemsize


def test_stochastic_gradient_rounding_needs_a_key_and_is_unbiased():
    recipe = EMULATE.replace(grad_rounding="stochastic")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    # a forward-only call (init, evaluation) rounds no gradient and needs no key ...
    y = jaxmx.dot_general(x, w, TN, recipe=recipe)
    np.testing.assert_array_equal(y, jaxmx.dot_general(x, w, TN, recipe=EMULATE))
    # ... a gradient does
    with pytest.raises(ValueError, match="needs a PRNG key"):
        jax.grad(lambda a: jaxmx.dot_general(a, w, TN, recipe=recipe).sum())(x)

    @jax.jit
    def dx_for(key):
        _, pullback = jax.vjp(lambda a: jaxmx.dot_general(a, w, TN, recipe=recipe, key=key), x)
        return pullback(g)[0]

    keys = jax.random.split(jax.random.key(0), 64)
    draws = np.stack([np.asarray(dx_for(k)) for k in keys])
    assert not np.array_equal(draws[0], draws[1])
    w_col = ref_fake_quant(np.asarray(w).T)  # [K, N], the dgrad copy of w
    exact = np.asarray(g, np.float64) @ w_col.T
    nearest_err = np.abs(ref_fake_quant(np.asarray(g)) @ w_col.T - exact).mean()
    mean_err = np.abs(draws.mean(0) - exact).mean()
    assert mean_err < nearest_err  # averaging unbiased draws beats round-to-nearest


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        jaxmx.dot_general(x, jnp.ones((4, 48)), TN, recipe=EMULATE)
    with pytest.raises(TypeError, match="int32"):
        jaxmx.dot_general(x.astype(jnp.int32), x, TN, recipe=EMULATE)
    with pytest.raises(ValueError, match="rank"):
        jaxmx.dot_general(x, x, (((2,), (1,)), ((), ())), recipe=EMULATE)
    with pytest.raises(TypeError):
        jaxmx.Recipe(fwdd="mxfp8_e4m3")
    with pytest.raises(ValueError, match="format"):
        jaxmx.Recipe(fwd="mxfp9")
    with pytest.raises(ValueError, match="backend"):
        jaxmx.Recipe(backend="tpu-magic")
    with pytest.raises(ValueError, match="residuals"):
        jaxmx.Recipe(residuals="none")
    with pytest.raises(TypeError, match="Recipe"):
        jaxmx.dot_general(x, x, TN, recipe="mxfp8")
    with pytest.raises(TypeError, match="preferred_element_type"):
        jaxmx.dot_general(x, x, TN, preferred_element_type=jnp.int32, recipe=EMULATE)


def test_einsum_matches_reference():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = rng.standard_normal((5, 64)).astype(np.float32)
    y = jaxmx.einsum("btd,hd->bth", x, w, recipe=EMULATE)
    xq, wq = ref_fake_quant(x), ref_fake_quant(w)
    bounds.assert_within(y, *ref_gemm(xq, wq))
    with pytest.raises(ValueError, match="two operands"):
        jaxmx.einsum("ij,jk,kl", x, w)


@pytest.mark.parametrize("backend", ["emulate", "ffi", "xla"])
def test_jit_with_captured_constants_matches_jit_with_arguments(backend):
    # XLA's constant folder evaluates computations on captured constants itself and gets bit
    # manipulation of transposed fp8 copies wrong: both ways must agree and match the reference.
    x, w, g = outlier_inputs(32, 64, 16)
    recipe = EMULATE.replace(backend=backend)

    def dx(a, b, c):
        return jax.vjp(lambda a: jaxmx.dot_general(a, b, TN, recipe=recipe), a)[1](c)[0]

    with_args = jax.jit(dx)(x, w, g)
    with_constants = jax.jit(lambda: dx(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)))()
    np.testing.assert_array_equal(with_args, with_constants)
    _, (g_row, w_col), _ = ref_dense_operands(x, w, g)
    bounds.assert_within(with_args, *ref_gemm(g_row, w_col))


@pytest.mark.parametrize("recipe", [EMULATE, EMULATE.replace(grad="mxfp8_e5m2")])
def test_ffi_backend_agrees_with_emulation(recipe):
    """The native custom call (its C++ twin on the CPU) gives a layer's output and gradients
    within twice each GEMM's bound of the emulation's, also under vmap."""
    x, w, g = outlier_inputs(40, 96, 64)
    fmts = (recipe.fwd, recipe.grad)
    native = jax.jit(layer_legs(recipe.replace(backend="ffi"), w, g))
    emulated = jax.jit(layer_legs(recipe, w, g))(x)
    assert_legs_within(native(x), emulated, x, w, g, fmts=fmts)
    vmapped = jax.jit(jax.vmap(layer_legs(recipe.replace(backend="ffi"), w, g)))(np.stack([x, -x]))
    assert_legs_within(vmapped, emulated, x, w, g, 0, fmts)


@pytest.mark.parametrize("backend", ["emulate", "ffi", "xla"])
def test_weights_stored_k_first_are_quantized_in_place(backend):
    """A weight stored [K, N] is never transposed (each copy is quantized along its own axis in
    place) and trains like the same weight stored [N, K]."""
    recipe = EMULATE.replace(backend=backend)
    x, w, g = outlier_inputs(40, 96, 64)

    def loss_kn(x, w_kn):
        return jnp.vdot(jaxmx.dot_general(x, w_kn, NN, recipe=recipe), g)

    def loss_nk(x, w):
        return jnp.vdot(jaxmx.dot_general(x, w, TN, recipe=recipe), g)

    grad_kn = jax.grad(loss_kn, (0, 1))
    if backend == "emulate":  # (the native GEMM transposes 1-byte codes where it must)
        assert "transpose" not in str(jax.make_jaxpr(grad_kn)(x, w.T))
    dx_kn, dw_kn = jax.jit(grad_kn)(x, w.T)
    dx, dw = jax.jit(jax.grad(loss_nk, (0, 1)))(x, w)
    _, dgrad, wgrad = ref_dense_operands(x, w, g)  # the same copies, so the same GEMMs
    for got, want, (a, b), what in ((dx_kn, dx, dgrad, "dx"), (dw_kn.T, dw, wgrad, "dw")):
        tol = bounds.between(bounds.abs_products(a, b), a.shape[-1], want)
        bounds.assert_within(got, want, tol, what)


def test_ffi_backend_lowers_to_the_custom_call():
    x, w = jnp.ones((8, 64)), jnp.ones((16, 64))
    f = jax.jit(lambda x, w: jaxmx.dot_general(x, w, TN, recipe=EMULATE.replace(backend="ffi")))
    assert "jaxmx_mx_matmul" in f.lower(x, w).as_text()


@pytest.mark.parametrize("backend", ["emulate", "ffi", "xla"])
@pytest.mark.parametrize(
    "a_k_first, b_k_first", [(False, False), (True, False), (False, True), (True, True)]
)
def test_matmul_takes_operands_blocked_along_either_last_axis(backend, a_k_first, b_k_first):
    rng = np.random.default_rng(6)
    m, n, k = 5, 7, 70
    a = rng.standard_normal((2, m, k)).astype(np.float32)
    b = rng.standard_normal((2, n, k)).astype(np.float32)

    def operand(x, k_first):  # K-first: the [.., K, rows] array quantized along its axis -2
        if k_first:
            return jaxmx.quantize(jnp.asarray(x).swapaxes(-1, -2), axis=-2)
        return jaxmx.quantize(jnp.asarray(x), axis=-1)

    out = jaxmx.matmul(operand(a, a_k_first), operand(b, b_k_first), jnp.float32, backend=backend)
    aq, bq = ref_fake_quant(a), ref_fake_quant(b)
    expected = np.einsum("bmk,bnk->bmn", aq, bq)
    tol = bounds.against_exact(bounds.abs_products(aq, bq), k, expected)
    bounds.assert_within(out, expected, tol)


def test_matmul_rejects_operands_not_blocked_along_k():
    q = jaxmx.quantize(jnp.ones((64, 4, 32)), axis=0)
    with pytest.raises(ValueError, match="quantized along K"):
        jaxmx.matmul(q, q)
    a, b = jaxmx.quantize(jnp.ones((4, 64))), jaxmx.quantize(jnp.ones((4, 96)))
    with pytest.raises(ValueError, match="contracting sizes differ"):
        jaxmx.matmul(a, b)


def test_emulated_gemm_is_the_mx_product_for_every_scale():
    """Over the whole E8M0 range, against the exact MX product in float64.

    Wherever no partial sum can leave float32's range, the result is the exact product up to
    float32 summation (and, on XLA:CPU, products below 2^-126 flushed to zero); where the exact
    result overflows float32 it is infinite. (A dot of operands decoded to float32 would overflow
    for every block whose decoded elements do, even where the product is finite.)
    """
    rng = np.random.default_rng(7)
    codes = rng.standard_normal((2, 256, 64)).astype(np.float32)
    a = jaxmx.quantize(jnp.asarray(codes[0]))
    b = jaxmx.quantize(jnp.asarray(codes[1]))
    byte_a = np.arange(256 * 2).reshape(256, 2) % 255
    byte_b = (np.arange(256 * 2).reshape(256, 2) * 7 + 3) % 255
    a = jaxmx.MXArray(
        a.data, jnp.asarray(byte_a, jnp.uint8).view(jnp.float8_e8m0fnu), a.fmt, 1, a.shape
    )
    b = jaxmx.MXArray(
        b.data, jnp.asarray(byte_b, jnp.uint8).view(jnp.float8_e8m0fnu), b.fmt, 1, b.shape
    )

    def decode(q, byte):
        return np.asarray(q.data).astype(np.float64) * np.ldexp(1.0, np.repeat(byte, 32, 1) - 127)

    da, db = decode(a, byte_a), decode(b, byte_b)
    want, sum_abs = da @ db.T, np.abs(da) @ np.abs(db).T
    got = np.asarray(jaxmx.matmul(a, b, jnp.float32, backend="emulate"), np.float64)
    f32_max = float(np.finfo(np.float32).max)
    in_range = sum_abs < f32_max / 2
    err = np.abs(got - want)[in_range]
    assert np.all(err <= 2.0**-17 * sum_abs[in_range] + 2.0**-118)
    overflow = np.abs(want) > f32_max * 1.01
    assert overflow.any() and in_range.any() and (~in_range & ~overflow).any()
    assert np.all(np.isinf(got[overflow]))
    # rows past float32's decode range that still give finite products are covered
    decoded_past_f32 = np.abs(da).max(1)[:, None] > f32_max
    assert (decoded_past_f32 & in_range).any()


def test_stochastic_rounding_block_supplies_a_key_per_gemm():
    recipe = EMULATE.replace(grad_rounding="stochastic")
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)

    def grads(key):
        def loss(x):
            y1 = jaxmx.dot_general(x, w1, TN, recipe=recipe)  # keyless: from the block
            y2 = jaxmx.dot_general(x, w2, TN, recipe=recipe)
            return jnp.sum(y1 * jnp.cos(y1)) + jnp.sum(y2 * jnp.sin(y2))

        with jaxmx.stochastic_rounding(key):
            return jax.grad(loss)(x)

    step = jax.jit(grads)
    k0, k1 = jax.random.key(0), jax.random.key(1)
    np.testing.assert_array_equal(step(k0), step(k0))  # deterministic per key
    assert not np.array_equal(step(k0), step(k1))  # and the key matters

    # the two GEMMs got fold_in(key, 0) and fold_in(key, 1): the same as passing those keys
    def explicit(key):
        def loss(x):
            y1 = jaxmx.dot_general(x, w1, TN, recipe=recipe, key=jax.random.fold_in(key, 0))
            y2 = jaxmx.dot_general(x, w2, TN, recipe=recipe, key=jax.random.fold_in(key, 1))
            return jnp.sum(y1 * jnp.cos(y1)) + jnp.sum(y2 * jnp.sin(y2))

        return jax.grad(loss)(x)

    np.testing.assert_array_equal(step(k0), jax.jit(explicit)(k0))
    with pytest.raises(ValueError, match="stochastic_rounding"):  # a gradient outside a block
        jax.grad(lambda x: jaxmx.dot_general(x, w1, TN, recipe=recipe).sum())(x)


def test_remat_saves_only_what_the_policy_allows(capsys):
    """No callback or custom_vmap output sneaks into the residuals of a rematerialized MLP."""

    def mlp(ws, x):
        h = jax.nn.relu(jaxmx.dot_general(x, ws[0], TN, recipe=EMULATE))
        return jaxmx.dot_general(h, ws[1], TN, recipe=EMULATE).sum()

    def saved(policy) -> list[str]:
        ws, x = (jnp.ones((128, 64)), jnp.ones((64, 128))), jnp.ones((32, 64))
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(mlp, policy=policy), ws, x)
        return [line for line in capsys.readouterr().out.splitlines() if line]

    assert all(
        "from the argument" in line for line in saved(jax.checkpoint_policies.nothing_saveable)
    )
    names = saved(jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE))
    copies = [line for line in names if "from the argument" not in line]
    assert len(copies) == 8, names  # codes and scales of two columnwise copies, two GEMMs
    assert all(LHS_COLWISE in line or RHS_COLWISE in line for line in copies), names
    assert all(line.startswith("u8[") for line in copies), names  # as bits: e4m3 codes, e8m0


def test_second_order_derivatives_are_refused_not_zero():
    """The hessian used to come out as zeros (finite, and wrong); tests/test_higher_order.py has
    the other second-order cases."""
    w = jnp.asarray(np.random.default_rng(9).standard_normal((8, 32)), jnp.float32)
    hessian = jax.hessian(lambda x: (jaxmx.dot_general(x, w, TN, recipe=EMULATE) ** 2).sum())
    with pytest.raises(NotImplementedError, match="second-order derivatives"):
        hessian(jnp.ones((2, 32)))


@pytest.mark.parametrize("backend", ["emulate", "ffi", "xla"])
@pytest.mark.parametrize(("m", "k", "n"), [(0, 64, 8), (4, 0, 8), (4, 64, 0), (0, 0, 0)])
def test_zero_size_dimensions_give_what_lax_gives(backend, m, k, n):
    recipe = EMULATE.replace(backend=backend)
    x, w = jnp.ones((m, k)), jnp.ones((n, k))

    def loss(f):
        return lambda x, w: (f(x, w, TN) * 2.0).sum()

    mx = functools.partial(jaxmx.dot_general, recipe=recipe)
    np.testing.assert_array_equal(mx(x, w, TN), jax.lax.dot_general(x, w, TN))
    got = jax.grad(loss(mx), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jax.lax.dot_general), argnums=(0, 1))(x, w)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_dequantize_of_quantize_has_a_zero_gradient():
    """Piecewise constant, and differentiated as such (documented on jaxmx.dequantize)."""
    x = jnp.linspace(-3.0, 3.0, 64)
    g = jax.grad(lambda x: jaxmx.dequantize(jaxmx.quantize(x)).sum())(x)
    np.testing.assert_array_equal(g, jnp.zeros_like(x))


def saved_residuals(fn, *args) -> list[tuple[str, int]]:
    """(dtype, size) of each residual ``fn``'s VJP saves, sorted."""
    from jax._src.ad_checkpoint import saved_residuals as residuals

    return sorted((aval.dtype.name, aval.size) for aval, _ in residuals(fn, *args))


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "names"])
def test_scanned_remat_saves_what_a_stock_model_saves(policy):
    """A scanned stack of transformer blocks under jax.checkpoint (jaxmx projections, MLP and
    attention products against lax.dot_general and jax.nn.dot_product_attention): the same
    residuals as the stock model, plus, when the policy names them, only the 8-bit copies."""
    names = jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE)
    chosen = names if policy == "names" else getattr(jax.checkpoint_policies, policy)

    def model(dot_general, attention):
        def block(x, w):  # x [32, 64]: causal self-attention (2 heads of 32), then an MLP
            q, k, v = (dot_general(x, w[i], TN).reshape(1, 32, 2, 32) for i in range(3))
            x = x + dot_general(attention(q, k, v, is_causal=True).reshape(32, 64), w[3], TN)
            h = jax.nn.gelu(dot_general(x, w[4], TN))
            return x + dot_general(h, w[5], TN)

        body = jax.checkpoint(block, policy=chosen)

        def loss(ws, x):
            y, _ = jax.lax.scan(lambda x, w: (body(x, w), None), x, ws)
            return y.sum()

        return loss

    def mx(a, b, dims):
        return jaxmx.dot_general(a, b, dims, recipe=EMULATE)

    def mx_attention(*args, **kwargs):
        return jaxmx.dot_product_attention(*args, **kwargs, recipe=EMULATE)

    ws, x = jnp.ones((3, 6, 64, 64)) * 0.01, jnp.ones((32, 64))
    stock = saved_residuals(model(jax.lax.dot_general, jax.nn.dot_product_attention), ws, x)
    got = saved_residuals(model(mx, mx_attention), ws, x)
    if policy == "names":
        extra = [r for r in got if r[0] == "uint8"]  # as bits: float8_e4m3fn, float8_e8m0fnu
        assert len(extra) == 4 * (6 + 2)  # codes, scales: two copies per GEMM, 8 GEMMs
        got = [r for r in got if r not in extra]
    assert got == stock


@pytest.mark.parametrize("residuals", ["quantized", "high_precision"])
def test_scanned_residuals_are_stacked_as_integers(residuals):
    """Under lax.scan each step's residuals are stacked; XLA:CPU stacks a float narrower than 32
    bits in float32, rewriting the whole stack at every step (quadratic in the steps). They are
    saved as unsigned integers of the same width, and the gradients stay the reference's."""
    recipe = EMULATE.replace(residuals=residuals)
    xs, ws, gs = (
        np.stack(a)
        for a in zip(outlier_inputs(64, 96, 48), outlier_inputs(64, 96, 48, 1), strict=True)
    )
    xs, ws, gs = (jnp.asarray(a, jnp.bfloat16) for a in (xs, ws, gs))  # gs: dot's cotangents
    dot = functools.partial(jaxmx.dot_general, dimension_numbers=TN, recipe=recipe)

    def loss(xs, ws):  # a cotangent gs[i] on step i's output
        step = lambda c, a: (c + (dot(a[0], a[1]).astype(jnp.float32) * a[2]).sum(), None)
        return jax.lax.scan(step, jnp.float32(0), (xs, ws, gs))[0]

    narrow = [
        d
        for d, _ in saved_residuals(loss, xs, ws)
        if jnp.issubdtype(d, jnp.floating) and d != "float32"
    ]
    assert narrow == []
    dxs, dws = jax.jit(jax.grad(loss, (0, 1)))(xs, ws)
    for i in range(2):
        x, w, g = (np.asarray(a[i], np.float32) for a in (xs, ws, gs))
        _, dgrad, wgrad = ref_dense_operands(x, w, g)
        for got, (a, b), what in ((dxs[i], dgrad, "dx"), (dws[i], wgrad, "dw")):
            bounds.assert_within(got, *ref_gemm(a, b, jnp.bfloat16), what)  # rounded to bf16


def test_bad_argument_types_raise_type_errors():
    x = jnp.ones((4, 32))
    with pytest.raises(TypeError, match="key must be a PRNG key"):
        jaxmx.quantize(x, key=123)
    with pytest.raises(TypeError, match="axis must be an integer"):
        jaxmx.quantize(x, axis=True)
    with pytest.raises(TypeError, match="dimension_numbers"):
        jaxmx.dot_general(x, x, (((1.7,), (1.2,)), ((), ())), recipe=EMULATE)
    q = jaxmx.quantize(x)
    for backend in ("emulate", "ffi"):
        with pytest.raises(TypeError, match="out_dtype must be float32, bfloat16 or float16"):
            jaxmx.matmul(q, q, jnp.int32, backend=backend)
