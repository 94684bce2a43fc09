"""jaxmx.diagnostics.collective_bytes against programs whose traffic is known by construction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def test_all_gather_and_all_reduce_of_a_compiled_program(mesh):
    codes = jax.device_put(
        jnp.zeros((1024, 64), jnp.uint8), NamedSharding(mesh, P("x", None))
    )  # 8 shards of 128 rows
    partial = jax.device_put(jnp.ones((8, 32), jnp.float32), NamedSharding(mesh, P("x", None)))

    def f(codes, partial):
        whole = jax.lax.with_sharding_constraint(codes, NamedSharding(mesh, P()))
        return whole, partial.sum(0)

    compiled = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(codes, partial).compile()
    b = jaxmx.diagnostics.collective_bytes(compiled)
    assert b.by_dtype("all-gather") == {"u8": 1024 * 64}  # the gathered array, per device
    assert b.of("all-reduce", "f32") == 32 * 4
    assert b.of("reduce-scatter") == b.of("all-to-all") == 0


def test_all_to_all_in_shard_map(mesh):
    x = jax.device_put(jnp.zeros((64, 16), jnp.uint8), NamedSharding(mesh, P("x")))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def f(x):  # [8, 16] per device
        return jax.lax.all_to_all(x, "x", 0, 0, tiled=True)

    b = jaxmx.diagnostics.collective_bytes(f.lower(x).compile())
    assert b.by_dtype("all-to-all") == {"u8": 8 * 16}  # each device's block, exchanged


def test_async_start_counts_its_results_once():
    text = """
      %ags = (u8[128,64]{1,0}, u8[1024,64]{1,0}) all-gather-start(u8[128,64]{1,0} %p)
      %agd = u8[1024,64]{1,0} all-gather-done((u8[128,64]{1,0}, u8[1024,64]{1,0}) %ags)
      %rs = bf16[16,8]{1,0} reduce-scatter(bf16[128,8]{1,0} %q), dimensions={0}, to_apply=%add
    """
    b = jaxmx.diagnostics.collective_bytes(text)
    assert b.bytes == {("all-gather", "u8"): 1024 * 64, ("reduce-scatter", "bf16"): 16 * 8 * 2}
    assert b.count == {"all-gather": 1, "reduce-scatter": 1}


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="collective kind"):
        jaxmx.diagnostics.collective_bytes("HloModule m").of("allgather")
    with pytest.raises(ValueError, match="unknown HLO dtype 'q7'"):
        jaxmx.diagnostics.collective_bytes("%a = q7[4]{0} all-reduce(q7[4]{0} %b)")
    with pytest.raises(TypeError, match="compiled program"):
        jaxmx.diagnostics.collective_bytes(np.zeros(3))


def test_what_is_not_optimized_hlo_is_refused():
    lowered = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"Lowered.*pass lowered.compile\(\)"):
        jaxmx.diagnostics.collective_bytes(lowered)
    with pytest.raises(ValueError, match="StableHLO"):
        jaxmx.diagnostics.collective_bytes(lowered.as_text())
    for text in ("", "all-gather of 4 bytes", "hello\nworld"):
        with pytest.raises(ValueError, match="the text is not HLO"):
            jaxmx.diagnostics.collective_bytes(text)
    compiled = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32)).compile()
    assert jaxmx.diagnostics.collective_bytes(compiled).count == {}  # HLO: read, no traffic
