"""jaxmx.fsdp_dot_general: hand-written FSDP in shard_map against the single-device step.

The reference is the stock single-device computation: jaxmx.dot_general on the whole weight
(itself checked against numpy in test_dot_general.py). The loss and the input gradient are
bit-identical; the weight gradient is the reduce-scatter of the devices' partial sums, equal to
float32 rounding. The HLO checks read the compiled program's collectives.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx import recipes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")

DIMS = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K] -> [M, N]
M, K, N = 256, 64, 256  # per device: 32 tokens, 32 weight rows
RECIPES = {
    "MXFP8": recipes.MXFP8,
    "MXFP8_2D": recipes.MXFP8_2D,
    "FP8_TENSORWISE": recipes.FP8_TENSORWISE,
    "MXINT8": recipes.MXFP8.replace(fwd="mxint8", grad="mxint8"),  # int8 codes gathered as u8
    "MXFP4": recipes.MXFP4.replace(grad_rounding="nearest", rht=False),  # FP4 codes two per byte
}
F32_ROUNDING = 8 * 2.0**-24  # a few float32 roundings of the largest gradient entry


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def operands(mesh):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K))
    w = jax.random.normal(kw, (N, K)) * 0.1
    sharded = jax.device_put((x, w), NamedSharding(mesh, P("fsdp")))
    return (x, w), sharded


@pytest.fixture(scope="module")
def steps(mesh, operands):
    """name -> (compiled sharded step, its (loss, (dx, dw)), the single-device one's)."""
    (x, w), (xs, ws) = operands

    @functools.cache
    def run(name):
        recipe = RECIPES[name]

        def reference(x, w):
            return jnp.sum(jnp.tanh(jaxmx.dot_general(x, w, DIMS, recipe=recipe)))

        def local(x, w):
            y = jaxmx.fsdp_dot_general(x, w, DIMS, axis_name="fsdp", gather_axis=0, recipe=recipe)
            return jax.lax.psum(jnp.sum(jnp.tanh(y)), "fsdp")

        sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
        step = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))
        compiled = step.lower(xs, ws).compile()
        want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, w)
        return compiled, compiled(xs, ws), want

    return run


@pytest.mark.parametrize("name", RECIPES)
def test_matches_the_single_device_step(steps, name):
    _, (loss, (dx, dw)), (want_loss, (want_dx, want_dw)) = steps(name)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)  # the loss's own sum, in 8 parts
    np.testing.assert_array_equal(dx, want_dx)
    atol = F32_ROUNDING * float(jnp.abs(want_dw).max())
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("name", "planes", "scale_bytes"),
    [
        ("MXFP8", 2, N * K // 32),
        ("MXFP8_2D", 1, N * K // (32 * 32)),
        ("FP8_TENSORWISE", 1, 0),
        ("MXINT8", 2, N * K // 32),
        ("MXFP4", 1, N * K // (32 * 32)),
    ],
)
def test_gathers_8_bit_codes_and_reduce_scatters_the_gradient(steps, name, planes, scale_bytes):
    compiled = steps(name)[0]
    b = jaxmx.diagnostics.collective_bytes(compiled)
    gathered = b.by_dtype("all-gather")
    code_bytes = N * K // 2 if name == "MXFP4" else N * K
    assert gathered == {"u8": planes * (code_bytes + scale_bytes)}  # MXFP8: 1.03 B per element
    assert b.by_dtype("reduce-scatter") == {"f32": N * K * 4 // 8}  # this shard's gradient
    if name == "FP8_TENSORWISE":  # the amaxes of x, w and the output gradient: one int32 each
        assert b.of("all-reduce", "s32") == 3 * 4


def test_scan_over_layers_with_remat(mesh):
    layers, d = 2, 256  # per device: 32 rows of each [256, 256] weight
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (M, d))
    w = jax.random.normal(kw, (layers, d, d)) * d**-0.5

    def stack(dot):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(dot(h, w)), None

        return lambda x, w: jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    reference = stack(lambda h, w: jaxmx.dot_general(h, w, DIMS))
    local = stack(lambda h, w: jaxmx.fsdp_dot_general(h, w, DIMS, axis_name="fsdp", gather_axis=0))
    sharded = jax.shard_map(
        lambda x, w: jax.lax.psum(local(x, w), "fsdp"),
        mesh=mesh,
        in_specs=(P("fsdp"), P(None, "fsdp")),
        out_specs=P(),
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "fsdp")))
    step = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))
    compiled = step.lower(xs, ws).compile()
    loss, (dx, dw) = compiled(xs, ws)
    want_loss, (want_dx, want_dw) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(dx, want_dx)
    atol = F32_ROUNDING * float(jnp.abs(want_dw).max())
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=atol)
    assert set(jaxmx.diagnostics.collective_bytes(compiled).by_dtype("all-gather")) == {"u8"}


def _inside_shard_map(mesh, fn, x, w, w_spec=None):
    w_spec = P("fsdp") if w_spec is None else w_spec
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(P("fsdp"), w_spec), out_specs=P("fsdp"))
    return jax.eval_shape(sharded, x, w)


def test_a_shard_that_splits_a_block_is_refused(mesh):
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((128, K), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def fn(x, w):  # 16 rows of w per shard: half a block
        return jaxmx.fsdp_dot_general(x, w, DIMS, axis_name="fsdp", gather_axis=0)

    with pytest.raises(jaxmx.BlockShardingError, match=r"16 rows .* multiple of 256"):
        _inside_shard_map(mesh, fn, x, w)


def test_gathering_a_contracting_dimension_is_refused(mesh):
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((N, K), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))

    def fn(x, w):
        return jaxmx.fsdp_dot_general(x, w, DIMS, axis_name="fsdp", gather_axis=1)

    with pytest.raises(ValueError, match=r"contracting dimension of rhs.*lax\.psum"):
        _inside_shard_map(mesh, fn, x, w, P(None, "fsdp"))


def test_unsupported_recipes_are_refused_by_name(mesh, operands):
    _, (xs, ws) = operands
    for recipe, match in (
        (recipes.FP8_ROWWISE, "'fp8_e4m3_row'"),
        (recipes.MXFP8.replace(residuals="high_precision"), "recipe.residuals='high_precision'"),
    ):

        def fn(x, w, recipe=recipe):
            return jaxmx.fsdp_dot_general(
                x, w, DIMS, axis_name="fsdp", gather_axis=0, recipe=recipe
            )

        with pytest.raises(ValueError, match=match):
            _inside_shard_map(mesh, fn, xs, ws)


def test_bfloat16_operands(mesh):
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (N, K)) * 0.1).astype(jnp.bfloat16)

    def reference(x, w):
        return jnp.sum(jnp.tanh(jaxmx.dot_general(x, w, DIMS)).astype(jnp.float32))

    def local(x, w):
        y = jaxmx.fsdp_dot_general(x, w, DIMS, axis_name="fsdp", gather_axis=0)
        return jax.lax.psum(jnp.sum(jnp.tanh(y).astype(jnp.float32)), "fsdp")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
    xs, ws = jax.device_put((x, w), NamedSharding(mesh, P("fsdp")))
    loss, (dx, dw) = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(xs, ws)
    want_loss, (want_dx, want_dw) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(dx, want_dx)
    # the float32 sum of the shards' partial gradients, rounded once to bfloat16: at most one
    # bfloat16 rounding step away from the single-device gradient
    diff = np.abs(dw.astype(np.float32) - want_dw.astype(np.float32))
    assert (diff <= 2.0**-7 * np.abs(want_dw.astype(np.float32)) + 1e-30).all()


def test_a_k_first_kernel_and_3d_activations(mesh):
    dims = (((2,), (0,)), ((), ()))  # x [batch, seq, K] . a Flax kernel [K, N], split along N
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (16, 16, K))  # 2 x 16 = 32 tokens per device
    w = jax.random.normal(kw, (K, N)) * 0.1

    def reference(x, w):
        return jnp.sum(jnp.tanh(jaxmx.dot_general(x, w, dims)))

    def local(x, w):
        y = jaxmx.fsdp_dot_general(x, w, dims, axis_name="fsdp", gather_axis=1)
        return jax.lax.psum(jnp.sum(jnp.tanh(y)), "fsdp")

    w_spec = P(None, "fsdp")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), w_spec), out_specs=P())
    xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    loss, (dx, dw) = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(xs, ws)
    want_loss, (want_dx, want_dw) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(dx, want_dx)
    atol = F32_ROUNDING * float(jnp.abs(want_dw).max())
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=atol)
