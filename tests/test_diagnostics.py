"""jaxmx.diagnostics.block_stats against a numpy reference computed from its definitions."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import jaxmx

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")


def reference_stats(x: np.ndarray, fmt: str, axis: int, mode: str) -> dict:
    """Per block, from the definitions, in float64; blocks along ``axis`` moved last."""
    spec = ref.SPECS[fmt]
    data, scale = ref.quantize(x, fmt, mode, axis=axis)
    decoded = ref.dequantize(data, scale, axis, x.shape)
    xm = np.moveaxis(x.astype(np.float64), axis, -1)
    dm = np.moveaxis(decoded, axis, -1)
    sm = np.moveaxis(scale, axis, -1).astype(np.int64)
    out = {k: np.zeros(sm.shape) for k in ("amax", "span", "under", "flushed", "sat", "sqnr")}
    out["scale_exp"] = np.where(sm == 255, 128, sm - 127)
    n = xm.shape[-1]
    for idx in np.ndindex(sm.shape):
        lo, hi = idx[-1] * 32, min(idx[-1] * 32 + 32, n)
        v, d = xm[idx[:-1]][lo:hi], dm[idx[:-1]][lo:hi]
        amax = np.max(np.abs(v))
        out["amax"][idx] = amax
        if not np.isfinite(amax):
            for k in ("span", "under", "flushed", "sat", "sqnr"):
                out[k][idx] = np.nan
            continue
        std = np.std(v)  # population
        out["span"][idx] = 0.0 if amax == 0 else (np.inf if std == 0 else amax / std)
        nz = v != 0
        scaled = np.abs(v) / 2.0 ** float(out["scale_exp"][idx])
        for key, hit in (
            ("under", scaled < 2.0**spec.emin),
            ("flushed", d == 0),
            ("sat", scaled > spec.elem_max),
        ):
            out[key][idx] = np.sum(nz & hit) / np.sum(nz) if nz.any() else 0.0
        noise = np.sum((v - d) ** 2)
        out["sqnr"][idx] = np.inf if noise == 0 else 10 * np.log10(np.sum(v**2) / noise)
    return {k: np.moveaxis(a, -1, axis) for k, a in out.items()}


def adversarial(seed=0) -> np.ndarray:
    """[6, 200] rows: normal, an outlier row, all zeros, subnormals, a NaN/inf row, tiny+huge."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 200)).astype(np.float32)
    x[1, 5] = 3e4  # one outlier widens its block
    x[2] = 0.0
    x[3] = rng.standard_normal(200).astype(np.float32) * np.float32(2.0**-140)  # subnormals
    x[4, 40], x[4, 100] = np.nan, np.inf
    x[5, ::7] *= 1e6  # several outliers: many elements underflow or flush
    x[0, 64:96] = 1.0  # a constant block: std 0
    return x  # 200 = 6 blocks and a partial one of 8: padding never counts


def assert_stats_equal(got, want: dict) -> None:
    """BlockStats ``got`` against a reference's per-block arrays."""
    np.testing.assert_array_equal(got.scale_exp, want["scale_exp"])
    np.testing.assert_array_equal(got.amax, want["amax"].astype(np.float32))
    for name, key in (("underflow", "under"), ("flushed", "flushed"), ("saturated", "sat")):
        np.testing.assert_allclose(getattr(got, name), want[key], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(got.span_ratio, want["span"], rtol=1e-4)
    np.testing.assert_allclose(got.sqnr_db, want["sqnr"], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("axis", [1, 0])
def test_block_stats_equal_the_definitions(fmt, mode, axis):
    x = adversarial()
    x = x if axis == 1 else x.T.copy()
    got = jax.jit(jaxmx.diagnostics.block_stats, static_argnums=(1, 2, 3))(
        jnp.asarray(x), fmt, axis, mode
    )
    want = reference_stats(x, fmt, axis, mode)
    assert_stats_equal(got, want)


def reference_nvfp4_stats(x: np.ndarray) -> dict:
    """NVFP4 block statistics along the last axis from the definitions: the elements scaled by
    ``r = (1 / g) / s`` in numpy float32, decoded values from the NVFP4 reference."""
    _, scale, g, decoded = ref.nvfp4(x)
    s = scale.astype(np.float32)
    n = x.shape[-1]
    out = {k: np.zeros(s.shape) for k in ("amax", "span", "under", "flushed", "sat", "sqnr")}
    effective = np.frexp(s.astype(np.float64) * np.float64(g))[1] - 1  # binade of s * g
    out["scale_exp"] = np.where(np.isnan(s), 128, effective)
    for idx in np.ndindex(s.shape):
        lo, hi = idx[-1] * 16, min(idx[-1] * 16 + 16, n)
        v, d = x[idx[:-1]][lo:hi], decoded[idx[:-1]][lo:hi].astype(np.float64)
        amax = np.max(np.abs(v))
        out["amax"][idx] = amax
        if np.isnan(s[idx]):
            for k in ("span", "under", "flushed", "sat", "sqnr"):
                out[k][idx] = np.nan
            continue
        r = np.minimum((np.float32(1) / g) / s[idx], ref.FLOAT32_MAX)
        scaled = np.abs(v * r)  # float32, as the quantizer computes it
        v = v.astype(np.float64)
        std = np.std(v)
        out["span"][idx] = 0.0 if amax == 0 else (np.inf if std == 0 else amax / std)
        nz = v != 0
        for key, hit in (("under", scaled < 1), ("flushed", d == 0), ("sat", scaled > 6)):
            out[key][idx] = np.sum(nz & hit) / np.sum(nz) if nz.any() else 0.0
        noise = np.sum((v - d) ** 2)
        out["sqnr"][idx] = np.inf if noise == 0 else 10 * np.log10(np.sum(v**2) / noise)
    return out


@pytest.mark.parametrize("scale", [1.0, 2.0**-130])
def test_nvfp4_block_stats_equal_the_definitions(scale):
    x = np.delete(adversarial(), 4, axis=0)  # no NaN row: it would make the tensor scale NaN
    x = (x.astype(np.float64) * scale).astype(np.float32)  # 2^-130: subnormal elements
    got = jax.jit(jaxmx.diagnostics.block_stats, static_argnums=1)(jnp.asarray(x), "nvfp4")
    want = reference_nvfp4_stats(x)
    assert_stats_equal(got, want)
    assert float(np.nanmax(got.saturated)) > 0  # E4M3-rounded block scales can saturate


def test_nvfp4_nan_tensor_makes_every_block_nonfinite():
    s = jaxmx.diagnostics.block_stats(jnp.asarray(adversarial()), "nvfp4")
    assert (np.asarray(s.scale_exp) == 128).all() and np.isnan(np.asarray(s.underflow)).all()


def test_nvfp4_summary_counts_every_block_of_a_nan_tensor_and_leaks_no_nan():
    x = np.ones((2, 64), np.float32)
    x[0, 3] = np.nan  # the tensor scale is NaN: every block is non-finite
    summary = jaxmx.diagnostics.block_stats(jnp.asarray(x), "nvfp4").summary()
    assert (summary["blocks"], summary["nonfinite_blocks"]) == (0, 8)
    numbers = {k: v for k, v in summary.items() if isinstance(v, float)}
    assert not any(np.isnan(v) for v in numbers.values()), numbers


def test_a_block_that_dequantizes_to_inf_is_saturated():
    x = np.full((2, 32), 3.4e38, np.float32)
    x[1] = np.linspace(1, 2, 32, dtype=np.float32)
    s = jaxmx.diagnostics.block_stats(jnp.asarray(x))
    # numpy: rceil scale 2^e, e = ceil(log2(amax / 448)); codes rounded to E4M3; times 2^e
    e = np.ceil(np.log2(np.abs(x).max(axis=1, keepdims=True) / 448.0))
    codes = (x / 2.0**e).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    with np.errstate(over="ignore"):
        dequantized = (codes * 2.0**e).astype(np.float32)
    overflow = np.mean(np.isinf(dequantized), axis=1)
    np.testing.assert_array_equal(np.asarray(s.saturated)[:, 0], overflow)
    assert overflow[0] == 1.0 and float(s.sqnr_db[0, 0]) == -np.inf
    assert float(s.sqnr_db[1, 0]) > 30  # the finite block as before


def test_the_statistics_see_what_they_should():
    s = jaxmx.diagnostics.block_stats(jnp.asarray(adversarial()))
    assert float(s.span_ratio[0, 2]) == np.inf  # the constant block
    assert float(s.span_ratio[2, 0]) == 0.0  # all zeros
    assert float(s.span_ratio[1, 0]) > 5.5  # one outlier in 32: near the sqrt(32) maximum
    assert float(s.underflow[5].max()) > 0.5  # blocks with 1e6 outliers
    assert np.isnan(s.underflow[4, 1]) and int(s.scale_exp[4, 1]) == 128  # the NaN block
    assert float(jnp.nanmax(s.saturated)) == 0.0  # rceil never saturates
    floor = jaxmx.diagnostics.block_stats(jnp.full((32,), 480.0), scale_mode="floor")
    assert float(floor.saturated[0]) == 1.0  # OCP floor clips the block maximum


def test_summary():
    x = jnp.asarray(adversarial())
    summary = jaxmx.diagnostics.block_stats(x).summary()
    assert summary["blocks"] + summary["nonfinite_blocks"] == 6 * 7
    assert summary["nonfinite_blocks"] == 2
    assert summary["span_limit"] == 448 / 2.0**-6
    assert 0 < summary["frac_blocks_underflowing"] <= 1
    counts, edges = summary["underflow_hist"]
    assert counts.sum() == summary["blocks"] and edges[0] == 0 and edges[-1] == 1


def test_bad_input():
    with pytest.raises(ValueError, match="unknown MX format"):
        jaxmx.diagnostics.block_stats(jnp.ones(32), "mxfp6")
    with pytest.raises(ValueError, match=r"covers the MX formats .* and NVFP4, not fp8_e4m3"):
        jaxmx.diagnostics.block_stats(jnp.ones(32), "fp8_e4m3_block")
    with pytest.raises(ValueError, match="unknown scale_mode 'rceil' for nvfp4"):
        jaxmx.diagnostics.block_stats(jnp.ones(32), "nvfp4", scale_mode="rceil")
    with pytest.raises(TypeError, match="block_stats: x"):
        jaxmx.diagnostics.block_stats(jnp.ones(32, jnp.int32))


def test_gemm_probe_reproduces_the_accumulation_precision_story():
    key = jax.random.key(0)

    def error(k, **kw):
        return jaxmx.diagnostics.gemm_probe(32, 32, k, distribution="uniform", key=key, **kw)

    limited = [error(k, accum_bits=14)["max_rel"] for k in (256, 1024, 4096)]
    assert limited[0] < limited[1] < limited[2]  # grows with K
    assert 5e-3 < limited[2] < 0.2  # percent-level at K = 4096, as DeepSeek-V3 reports (~2%)
    promoted = error(4096, accum_bits=14, promote_every=128)["max_rel"]
    assert promoted < limited[2] / 10  # promotion every 128 elements: an order of magnitude
    assert error(4096)["max_rel"] < promoted / 100  # exact float32 accumulation
    normal = jaxmx.diagnostics.gemm_probe(32, 32, 1024, key=key)
    assert normal["fro_rel"] < 1e-6 < 0.01 < normal["quantization_fro_rel"] < 0.1


def test_gemm_probe_arguments():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="promote_every needs accum_bits"):
        jaxmx.diagnostics.gemm_probe(4, 4, 64, promote_every=128, key=key)
    with pytest.raises(ValueError, match="multiple of 32"):
        jaxmx.diagnostics.gemm_probe(4, 4, 64, accum_bits=14, promote_every=48, key=key)
    with pytest.raises(ValueError, match="distribution"):
        jaxmx.diagnostics.gemm_probe(4, 4, 64, distribution="cauchy", key=key)
