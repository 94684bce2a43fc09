"""jaxmx.expert_parallel_ffn on 8 CPU devices against the same routing on one device
(jaxmx.ragged_dot of the tokens sorted by expert), and the bytes its all-to-alls move."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx._src.training.ragged import quantized_ragged_dot

N, E_LOCAL, T, D, H, K, CAPACITY = 8, 2, 128, 64, 32, 2, 8  # T tokens over the N devices
E = N * E_LOCAL
MXFP8 = jaxmx.recipes.MXFP8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("expert",))


def layer_inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, D))
    ids = jax.random.randint(ks[1], (T, K), 0, E)
    gates = jax.nn.softmax(jax.random.normal(ks[2], (T, K)))
    w_in = jax.random.normal(ks[3], (E, D, H)) * D**-0.5
    w_out = jax.random.normal(ks[4], (E, H, D)) * H**-0.5
    return x, ids, gates, w_in, w_out


def sharded(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in arrays]


def expert_parallel(mesh, recipe, capacity=CAPACITY):
    """(x, ids, gates, w_in, w_out) -> (y, dropped), the experts over the 8 devices."""

    def ffn(*a):
        return jaxmx.expert_parallel_ffn(*a, axis_name="expert", capacity=capacity, recipe=recipe)

    return jax.shard_map(ffn, mesh=mesh, in_specs=P("expert"), out_specs=(P("expert"), P()))


def one_device(recipe, keep=None):
    """The same layer on one device: the assignments sorted by expert (stable: in token order,
    the order the dispatch delivers them in), the stock two grouped GEMMs, the gated sum.
    ``keep [T, K]``: which assignments count (the others are dropped)."""

    def gemm(a, w, sizes):
        if recipe is None:
            return jax.lax.ragged_dot(a, w, sizes)
        return jaxmx.ragged_dot(a, w, sizes, recipe=recipe)

    def layer(x, ids, gates, w_in, w_out):
        flat = ids.reshape(-1)
        if keep is not None:
            flat = jnp.where(keep.reshape(-1), flat, E)  # past the last group: zeros
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E)
        out = gemm(jax.nn.gelu(gemm(jnp.repeat(x, K, 0)[order], w_in, sizes)), w_out, sizes)
        per_assignment = jnp.zeros_like(out).at[order].set(out).reshape(T, K, D)
        return (per_assignment * gates[..., None]).sum(1)

    return layer


def loss_grads(layer):
    def loss(x, w_in, w_out, ids, gates):
        y = layer(x, ids, gates, w_in, w_out)
        return (y[0] if isinstance(y, tuple) else y).astype(jnp.float32).__pow__(2).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.fixture(scope="module")
def mxfp8_results(mesh):
    """(forward and gradients on 8 devices, on one device, compiled forward, compiled grad)."""
    x, ids, gates, w_in, w_out = args = layer_inputs()
    sharded_args = sharded(mesh, *args)
    ep = jax.jit(expert_parallel(mesh, MXFP8))
    ep_grad = loss_grads(expert_parallel(mesh, MXFP8))
    grad_args = (sharded_args[0], sharded_args[3], sharded_args[4], *sharded_args[1:3])
    y, dropped = ep(*sharded_args)
    ref = one_device(MXFP8)
    return dict(
        y=y,
        dropped=dropped,
        grads=ep_grad(*grad_args),
        y_ref=jax.jit(ref)(*args),
        grads_ref=loss_grads(ref)(x, w_in, w_out, ids, gates),
        forward=ep.lower(*sharded_args).compile(),
        backward=ep_grad.lower(*grad_args).compile(),
    )


def test_mxfp8_forward_matches_one_device_bit_for_bit(mxfp8_results):
    r = mxfp8_results
    assert int(r["dropped"]) == 0
    np.testing.assert_array_equal(np.asarray(r["y"]), np.asarray(r["y_ref"]))


def test_mxfp8_gradients_match_one_device_bit_for_bit(mxfp8_results):
    # the wgrad of the first GEMM requantizes the received 8-bit tokens columnwise; on these
    # Gaussian tokens no element is an E4M3 subnormal in its block, so that is exact
    for got, want, name in zip(
        mxfp8_results["grads"], mxfp8_results["grads_ref"], "x w_in w_out".split(), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


DISPATCHED = E * CAPACITY * D  # elements of the send buffer per device, empty slots included


def test_dispatch_moves_uint8_and_the_combine_float32(mxfp8_results):
    sent = jaxmx.diagnostics.collective_bytes(mxfp8_results["forward"]).by_dtype("all-to-all")
    # codes (1 byte) and E8M0 scales (1 per 32) of the tokens: 1.03 bytes per element; the
    # counts per expert (int32); the combine in float32. A dispatch in high precision adds
    # float32 bytes (and removes the uint8 ones), so the exact dict fails.
    assert sent == {"u8": DISPATCHED * 33 // 32, "s32": 4 * E, "f32": 4 * DISPATCHED}


def test_backward_sends_the_dispatch_cotangent_in_float32(mxfp8_results):
    sent = jaxmx.diagnostics.collective_bytes(mxfp8_results["backward"]).by_dtype("all-to-all")
    # the forward's uint8 and counts; float32: the combine, its transpose and the dispatch's
    assert sent == {"u8": DISPATCHED * 33 // 32, "s32": 4 * E, "f32": 3 * 4 * DISPATCHED}


def test_high_precision_layer_matches_lax_ragged_dot(mesh):
    args = layer_inputs(1)
    y, dropped = jax.jit(expert_parallel(mesh, None))(*sharded(mesh, *args))
    assert int(dropped) == 0
    # the same row-by-row GEMMs: equal; no 8-bit bytes on the wire
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(one_device(None))(*args)))
    compiled = jax.jit(expert_parallel(mesh, None)).lower(*sharded(mesh, *args)).compile()
    assert "u8" not in jaxmx.diagnostics.collective_bytes(compiled).by_dtype("all-to-all")


def kept(ids, capacity):
    """[T, K] booleans: the assignments that get a slot, by numpy: on each device, in token
    order then choice order, the first ``capacity`` of each expert."""
    ids = np.asarray(ids).reshape(N, T // N * K)
    keep = np.zeros_like(ids, bool)
    for device, row in enumerate(ids):
        seen = {}
        for j, expert in enumerate(row):
            seen[expert] = seen.get(expert, 0) + 1
            keep[device, j] = seen[expert] <= capacity
    return keep.reshape(T, K)


def test_assignments_past_the_capacity_are_dropped_and_counted(mesh):
    x, ids, gates, w_in, w_out = args = layer_inputs(2)
    ids = ids.at[: T // 2, 0].set(3)  # expert 3 overloaded on the first half of the devices
    capacity = 4
    keep = kept(ids, capacity)
    assert not keep.all()
    args = (x, ids, gates, w_in, w_out)
    y, dropped = jax.jit(expert_parallel(mesh, MXFP8, capacity))(*sharded(mesh, *args))
    assert int(dropped) == int((~keep).sum())
    want = jax.jit(one_device(MXFP8, jnp.asarray(keep)))(*args)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_ragged_dot_takes_quantized_tokens_without_a_decode():
    x, _, _, w_in, _ = layer_inputs(3)
    sizes = jnp.array([40] * 3 + [8] + [0] * (E - 4))
    q = jaxmx.quantize(x, axis=1)
    np.testing.assert_array_equal(
        np.asarray(jaxmx.ragged_dot(q, w_in, sizes)), np.asarray(jaxmx.ragged_dot(x, w_in, sizes))
    )

    def loss(c, w):  # the carrier takes the input gradient
        return (quantized_ragged_dot(q, c, w, sizes) ** 2).sum()

    got = jax.grad(loss, (0, 1))(jnp.zeros_like(x), w_in)
    want = jax.grad(lambda x, w: (jaxmx.ragged_dot(x, w, sizes) ** 2).sum(), (0, 1))(x, w_in)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ragged_dot_refuses_an_mxarray_in_another_layout():
    x, _, _, w_in, _ = layer_inputs(3)
    sizes = jnp.full((E,), T // E)
    with pytest.raises(ValueError, match="recipe's forward format 'mxfp8_e4m3' blocked along K"):
        jaxmx.ragged_dot(jaxmx.quantize(x, axis=0), w_in, sizes)
    with pytest.raises(ValueError, match="forward format"):
        jaxmx.ragged_dot(jaxmx.quantize(x, "mxfp8_e5m2", axis=1), w_in, sizes)


def test_bad_arguments_raise(mesh):
    x, ids, gates, w_in, w_out = layer_inputs()
    run = lambda ids, capacity=CAPACITY, recipe=MXFP8: expert_parallel(mesh, recipe, capacity)(
        *sharded(mesh, x, ids, gates, w_in, w_out)
    )
    _, dropped = run(ids.at[:3, 1].set(E).at[3, 0].set(-1))
    assert int(dropped) == 4  # ids outside [0, E): dropped and counted
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        run(ids, capacity=0)
    with pytest.raises(NotImplementedError, match="not whole bytes"):
        run(ids, recipe=jaxmx.recipes.MXFP4)


def test_block_fp8_dispatch_sends_its_float32_scales_as_bytes(mesh):
    recipe = jaxmx.recipes.FP8_BLOCK_POW2  # 128-blocks: d = 64 is one block, zero-padded
    args = layer_inputs(4)
    ep = jax.jit(expert_parallel(mesh, recipe))
    y, _ = ep(*sharded(mesh, *args))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(one_device(recipe))(*args)))
    sent = jaxmx.diagnostics.collective_bytes(ep.lower(*sharded(mesh, *args)).compile())
    # d codes per token (the padding stays home) and one float32 scale as 4 bytes
    assert sent.by_dtype("all-to-all")["u8"] == DISPATCHED + E * CAPACITY * 4
