"""One process of tests/test_multiprocess.py: ``python multiprocess_worker.py PORT PROCESS_ID``.

Two processes of 4 CPU devices each join through ``jax.distributed`` (gloo collectives) into one
8-device mesh. Each process runs an FSDP step (``jaxmx.fsdp_dot_general`` in ``shard_map``) in
MXFP8 and MXFP4 on global arrays and compares it with the single-device ``jaxmx.dot_general``
step on its own first device (as tests/test_fsdp_shard_map.py does in one process); then
``granularity`` and ``block_stats`` of a global array against the same on one device. Prints
``ok <check>`` per check; any mismatch raises.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

DIMS = (((1,), (1,)), ((), ()))
M, K, N = 256, 64, 256
F32_ROUNDING = 8 * 2.0**-24  # as tests/test_fsdp_shard_map.py: the reduce-scattered wgrad


def main(port: int, process_id: int) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import jaxmx
    from jaxmx import diagnostics, recipes

    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(0)  # the same data in both processes
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    sharding = NamedSharding(mesh, P("fsdp"))
    xs, ws = (jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in (x, w))
    one = jax.local_devices()[0]

    for name, recipe in (
        ("MXFP8", recipes.MXFP8),
        ("MXFP4", recipes.MXFP4.replace(grad_rounding="nearest", rht=False)),
    ):

        def reference(x, w, recipe=recipe):
            return jnp.sum(jnp.tanh(jaxmx.dot_general(x, w, DIMS, recipe=recipe)))

        def local(x, w, recipe=recipe):
            y = jaxmx.fsdp_dot_general(x, w, DIMS, axis_name="fsdp", gather_axis=0, recipe=recipe)
            return jax.lax.psum(jnp.sum(jnp.tanh(y)), "fsdp")

        step = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
        loss, (dx, dw) = jax.jit(jax.value_and_grad(step, argnums=(0, 1)))(xs, ws)
        want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(*jax.device_put((x, w), one))
        want_loss, (want_dx, want_dw) = jax.tree.map(np.asarray, want)
        dx, dw = (multihost_utils.process_allgather(a, tiled=True) for a in (dx, dw))
        # the loss sums M x N terms in another order: float32 summation error, relative 2^-16
        # of the sum of their magnitudes (as tests/test_spmd.py)
        sum_abs = float(jnp.abs(jnp.tanh(jaxmx.dot_general(x, w, DIMS, recipe=recipe))).sum())
        assert abs(float(loss) - float(want_loss)) <= 2.0**-16 * sum_abs, (loss, want_loss)
        np.testing.assert_array_equal(dx, want_dx)
        atol = F32_ROUNDING * float(np.abs(want_dw).max())
        np.testing.assert_allclose(dw, want_dw, rtol=0, atol=atol)
        print(f"ok fsdp {name}", flush=True)

    with jax.set_mesh(mesh):
        got = jax.jit(diagnostics.granularity)(xs)
        got_stats = jax.jit(diagnostics.block_stats)(xs)
    want = diagnostics.granularity(jax.device_put(x, one))
    assert got.recommendation == want.recommendation, (got.recommendation, want.recommendation)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g = multihost_utils.process_allgather(g, tiled=True)
        np.testing.assert_allclose(g, np.asarray(r), rtol=2.0**-16)
    want_stats = diagnostics.block_stats(jax.device_put(x, one))
    for g, r in zip(jax.tree.leaves(got_stats), jax.tree.leaves(want_stats), strict=True):
        g = multihost_utils.process_allgather(g, tiled=True)
        np.testing.assert_allclose(g, np.asarray(r), rtol=2.0**-16)
    print("ok diagnostics", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
