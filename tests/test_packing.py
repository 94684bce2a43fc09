"""Packed codes at rest: 4-bit codes two per byte, FP6 four per three bytes, wherever an MXArray
lives (the array itself, transforms, the KV cache, weights at rest, orbax checkpoints).

The held bytes themselves are checked against a numpy packing of the reference quantizer's
codes for every format in tests/test_format_properties.py; here, what the device and the disk
hold, and that every consumer reads the codes back.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from flax import nnx

import jaxmx
import jaxmx.flax.nnx as mxnnx
from jaxmx._src.core.mxarray_layouts import swap_last_axes

PACKED = {"mxfp4": 4, "nvfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6}  # bits held per code


def device_bytes(tree) -> int:
    return sum(leaf.on_device_size_in_bytes() for leaf in jax.tree.leaves(tree))


def test_a_quantized_tensor_holds_its_codes_packed():
    x = jax.random.normal(jax.random.key(0), (64, 256))
    for fmt, bits in PACKED.items():
        q = jaxmx.quantize(x, fmt)
        assert q.held.dtype == jnp.uint8 and q.held.shape == (64, 256 * bits // 8), fmt
        assert q.held.on_device_size_in_bytes() == 64 * 256 * bits // 8, fmt
        assert q.data.shape == (64, 256) and q.data.dtype == jaxmx.FORMATS[fmt].dtype, fmt


PACKING_FORMATS = [name for name, f in jaxmx.FORMATS.items() if f.packing is not None]


def test_eager_packing_lowers_one_program_per_shape():
    """Packing and unpacking run eagerly (``quantize``, ``MXArray.data``) as one program each,
    not one per operation (10 to 15 programs for an eager quantize, 6 to 9 for its ``.data``,
    before): every format of the table that packs its codes."""
    lowered = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for i, fmt in enumerate(PACKING_FORMATS):
            x = jnp.ones((3 + i, 544))  # a shape no other test uses: nothing compiled before
            lowered.clear()
            q = jaxmx.quantize(x, fmt)
            assert len(lowered) == 2, (fmt, "quantize", len(lowered))  # codes and scales, pack
            lowered.clear()
            assert q.data.shape == x.shape
            assert len(lowered) == 1, (fmt, "unpack", len(lowered))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2"])
def test_transforms_read_the_codes_back(fmt):
    """Under vmap (leaves with a leading dim the logical shape lacks, blocks along axis 0 of
    each slice) and jit the values are the reference's."""
    x = np.asarray(jax.random.normal(jax.random.key(1), (3, 64, 5)), np.float32)
    q = jax.jit(jax.vmap(lambda s: jaxmx.quantize(s, fmt, axis=0)))(jnp.asarray(x))
    assert q.held.shape == (3, 64 * PACKED[fmt] // 8, 5)
    got = np.asarray(jax.vmap(jaxmx.dequantize)(q), np.float64)
    f = jaxmx.FORMATS[fmt]
    want = np.stack([ref.quantized(f, s, axis=0).values for s in x])
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_a_tiled_transpose_is_packed_along_its_new_block_axis():
    x = np.asarray(jax.random.normal(jax.random.key(2), (32, 48)), np.float32)
    q = jaxmx.quantize(jnp.asarray(x), "nvfp4", tile=(16, 16))
    t = swap_last_axes(q)
    assert t.held.shape == (48, 16) and t.data.shape == (48, 32)
    np.testing.assert_array_equal(jaxmx.dequantize(t), np.asarray(jaxmx.dequantize(q)).T)


def test_a_tile_width_that_splits_a_packed_group_is_refused():
    with pytest.raises(ValueError, match=r"mxfp4 packs 2 codes into 1 byte.*multiple of 2"):
        jaxmx.quantize(jnp.ones((4, 5)), "mxfp4", tile=(2, 5))
    with pytest.raises(ValueError, match=r"mxfp6_e2m3 packs 4 codes into 3 bytes"):
        jaxmx.quantize(jnp.ones((4, 6)), "mxfp6_e2m3", tile=(2, 6))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp6_e2m3"])
def test_a_kv_cache_holds_packed_codes(fmt):
    batch, max_len, heads, head_dim = 2, 16, 2, 64
    block = jaxmx.FORMATS[fmt].block
    scale_bytes = 1  # E8M0 or E4M3
    cache = jaxmx.KVCache.create(batch, max_len, heads, head_dim, fmt=fmt, page_size=8)
    tokens = batch * max_len * heads
    want = 2 * tokens * (head_dim * PACKED[fmt] // 8 + head_dim // block * scale_bytes)
    assert cache.nbytes == want + cache.page_table.size * 4
    assert cache.nbytes == device_bytes(cache)
    k = jax.random.normal(jax.random.key(3), (batch, 5, heads, head_dim))
    cache = cache.update(k, k, 0)
    got = np.asarray(jaxmx.dequantize(cache.keys()))[:, :, :5]
    want_k = np.asarray(jaxmx.dequantize(jaxmx.quantize(k, fmt, -1, global_scale=_g(fmt))))
    np.testing.assert_array_equal(got, want_k.transpose(0, 2, 1, 3))


def _g(fmt):
    return 1.0 if fmt == "nvfp4" else None


def test_nvfp4_weights_at_rest_hold_a_fifth_of_the_float32_state():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(256, 512, rngs=rngs), nnx.Linear(512, 256, rngs=rngs))
    before = device_bytes(nnx.state(model))
    x = jax.random.normal(jax.random.key(4), (4, 256))
    want = np.asarray(model(x))
    mxnnx.quantize_weights(model, "nvfp4")
    after = device_bytes(nnx.state(model))
    assert after <= 0.2 * before, after / before
    # and the layers still compute from them (NVFP4's rounding, not garbage)
    got = np.asarray(model(x))
    assert np.abs(got - want).max() < 0.25 * np.abs(want).max()


def test_an_orbax_checkpoint_saves_the_packed_codes(tmp_path):
    x = jax.random.normal(jax.random.key(5), (128, 512))
    q = jaxmx.quantize(x, "mxfp4")
    path = os.path.join(tmp_path, "ckpt")
    jaxmx.checkpoints.save_orbax(path, {"w": q})
    on_disk = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)
    assert on_disk <= q.nbytes + 32 * 1024  # the packed bytes (compressed) and orbax's metadata
    back = jaxmx.checkpoints.restore_orbax(path, {"w": q})["w"]
    assert back.held.dtype == jnp.uint8 and back.held.shape == (128, 256)
    np.testing.assert_array_equal(np.asarray(back.held), np.asarray(q.held))
    codes = np.asarray(back.data).view(np.uint8)
    assert codes.max() < 16 and np.asarray(back.data).dtype == ml_dtypes.float4_e2m1fn
