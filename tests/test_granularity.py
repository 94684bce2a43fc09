"""The granularity advisor (jaxmx.diagnostics.granularity / advise / advised_recipes) and the
per-layer recipe mapping of quantize_model, against an independent numpy + ml_dtypes reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx
import jaxmx.flax.linen as mxl
from jaxmx import diagnostics

ELEMENTS = {  # element: (dtype, elem_max, emin, the MX twin's emax)
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0, -6),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0, -14),
    "fp4_e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 0),
}


# --- the independent reference: group reshape, amax, scale, clip, cast ----------------------


def _cast(v, dtype, elem_max):
    return np.clip(v, -elem_max, elem_max).astype(dtype).astype(np.float32)


def _groups(x, level):
    """[groups, size] of a 2-D x whose sides are multiples of 128."""
    m, n = x.shape
    if level == "tensor":
        return x.reshape(1, -1)
    if level == "row":
        return x
    if level == "128x128":
        return x.reshape(m // 128, 128, n // 128, 128).transpose(0, 2, 1, 3).reshape(-1, 128 * 128)
    block = {"1x128": 128, "mx32": 32, "nvfp4_16": 16}[level]
    return x.reshape(-1, block)


def _ungroup(g, x, level):
    m, n = x.shape
    if level == "128x128":
        return g.reshape(m // 128, n // 128, 128, 128).transpose(0, 2, 1, 3).reshape(m, n)
    return g.reshape(m, n)


def reference(x, level, element):
    """(codes, dequantized) of x at ``level``, computed from the definitions."""
    dtype, elem_max, _ = ELEMENTS[element]
    g = _groups(x, level)
    amax = np.abs(g).max(axis=1, keepdims=True)
    if level in ("tensor", "row"):  # torchao current scaling: elem_max / amax, float32
        scale = np.float32(elem_max) / np.maximum(amax, np.float32(1e-12))
        codes = _cast(g * scale, dtype, elem_max)
        xhat = codes / scale
    elif level == "nvfp4_16":  # torchao's NVFP4: tensor scale t, E4M3 block scales s
        f32 = np.float32
        t = np.maximum(np.abs(x).max() / f32(448 * 6), f32(2.0**-126))
        s = np.clip((amax / f32(6)) / t, f32(2.0**-6), f32(448))
        s = s.astype(ml_dtypes.float8_e4m3fn).astype(f32)
        r = np.minimum((f32(1) / t) / s, np.finfo(f32).max)
        codes = _cast(g * r, dtype, elem_max)
        xhat = (codes * s) * t
    elif level == "mx32":  # E8M0 rceil: 2^ceil(log2(amax / elem_max))
        mant, ex = np.frexp(amax * np.float32(1 / elem_max))
        e = np.where(mant == 0.5, ex - 1, ex).astype(np.float32)
        codes = _cast(g * np.float32(2.0) ** -e, dtype, elem_max)
        xhat = codes * np.float32(2.0) ** e
    else:  # block FP8: float32 scale amax / elem_max
        s = np.maximum(amax / np.float32(elem_max), np.float32(2.0**-126))
        codes = _cast(g / s, dtype, elem_max)
        xhat = codes * s
    return _ungroup(codes, x, level), _ungroup(xhat, x, level), g


def reference_stats(x, level, element):
    _, _, emin = ELEMENTS[element]
    codes, xhat, groups = reference(x, level, element)
    nonzero = x != 0
    x64, e64 = x.astype(np.float64), (x.astype(np.float64) - xhat)
    spans = np.abs(groups).max(axis=1) / groups.std(axis=1)
    return {
        "underflow": np.mean(np.abs(codes[nonzero]) < 2.0**emin),
        "flushed": np.mean(codes[nonzero] == 0),
        "sqnr_db": 10 * np.log10(np.sum(x64**2) / np.sum(e64**2)),
        "span_max": spans.max(),
        "span_p50": np.percentile(spans, 50, method="inverted_cdf"),
        "groups": spans.size,
    }


# --- crafted inputs ---------------------------------------------------------------------------


def _normal(shape, seed=0):
    return np.array(jax.random.normal(jax.random.key(seed), shape), np.float32)


def no_outliers():
    return _normal((128, 256))


def row_magnitudes():  # rows 10^7 apart: one scale per row holds each
    return _normal((128, 256)) * np.logspace(0, 7, 128, dtype=np.float32)[:, None]


def outlier_in_rows():  # one outlier per row, in the 128-block r % 8 of row r
    x = _normal((128, 1024))
    rows = np.arange(128)
    x[rows, (rows % 8) * 128 + 5] = 1e7
    return x


def outlier_in_every_block():  # one outlier in every 32-block
    x = _normal((128, 256))
    x[:, ::32] = 1e7
    return x


CASES = {
    "no_outliers": (no_outliers, 0.01, "tensor"),
    "row_magnitudes": (row_magnitudes, 0.01, "row"),
    "outlier_in_rows": (outlier_in_rows, 0.2, "1x128"),
    "outlier_in_every_block": (outlier_in_every_block, 0.2, "mx32"),
}


@pytest.mark.parametrize("case", CASES)
def test_statistics_match_numpy_reference(case):
    make, budget, _ = CASES[case]
    x = make()
    g = jax.jit(lambda x: diagnostics.granularity(x, underflow_budget=budget))(jnp.asarray(x))
    assert g.names == ("tensor", "row", "128x128", "1x128", "mx32")
    for level, stats in g.levels.items():
        ref = reference_stats(x, level, "fp8_e4m3")
        for field in ("underflow", "flushed", "span_max", "span_p50", "groups"):
            np.testing.assert_allclose(
                float(getattr(stats, field)),
                ref[field],
                rtol=1e-5,
                err_msg=f"{case} {level} {field}",
            )
        np.testing.assert_allclose(float(stats.sqnr_db), ref["sqnr_db"], atol=1e-3)
        assert float(stats.saturated) == 0.0


@pytest.mark.parametrize("element", ["fp8_e5m2", "fp4_e2m1"])
def test_other_elements_match_numpy_reference(element):
    x = outlier_in_rows()[:, :256] * np.float32(1e-3)
    levels = ("mx32", "nvfp4_16") if element == "fp4_e2m1" else ("tensor", "row", "mx32")
    g = diagnostics.granularity(jnp.asarray(x), fmt=element, levels=levels)
    assert g.names == levels
    for level, stats in g.levels.items():
        ref = reference_stats(x, level, element)
        for field in ("underflow", "flushed"):
            np.testing.assert_allclose(float(getattr(stats, field)), ref[field], rtol=1e-5)
        np.testing.assert_allclose(float(stats.sqnr_db), ref["sqnr_db"], atol=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_recommendation(case):
    make, budget, expected = CASES[case]
    g = diagnostics.granularity(jnp.asarray(make()), underflow_budget=budget)
    rec = g.recommendation
    assert rec.level == expected, g.table()
    if case == "outlier_in_every_block":  # no level passes: the finest, and the hint
        assert "Hadamard" in rec.reason
    else:
        assert "<= budget" in rec.reason
    assert f"recommendation: {expected}" in str(g)


def test_axis_and_format_names():
    x = row_magnitudes()
    by_rows = diagnostics.granularity(jnp.asarray(x), fmt="mxfp8_e4m3", levels="row")
    by_cols = diagnostics.granularity(
        jnp.asarray(x.T), fmt=jaxmx.FORMATS["fp8_e4m3_block"], axis=0, levels="row"
    )
    assert by_rows.element == by_cols.element == "fp8_e4m3"
    assert float(by_rows.levels["row"].underflow) == float(by_cols.levels["row"].underflow)
    nvfp4 = diagnostics.granularity(jnp.asarray(x), fmt="nvfp4")
    assert nvfp4.names == ("mx32", "nvfp4_16")  # no per-tensor or per-row 4-bit format


def test_bad_input():
    x = jnp.ones((4, 128))
    with pytest.raises(ValueError, match="unknown level"):
        diagnostics.granularity(x, levels=("1x64",))
    with pytest.raises(ValueError, match="unknown fmt 'int8'"):
        diagnostics.granularity(x, fmt="int8")
    with pytest.raises(ValueError, match=r"'128x128' tiles the last two axes.*1-D"):
        diagnostics.granularity(jnp.ones(256), levels=("128x128",))
    with pytest.raises(ValueError, match="fp8_e4m3 has no level"):
        diagnostics.granularity(x, levels=("nvfp4_16",))
    with pytest.raises(ValueError, match="fp4_e2m1 has no level"):
        diagnostics.granularity(x, fmt="fp4_e2m1", levels=("tensor",))
    with pytest.raises(ValueError, match="underflow_budget"):
        diagnostics.granularity(x, underflow_budget=2)
    assert "128x128" not in diagnostics.granularity(jnp.ones(256)).names
    with pytest.raises(ValueError, match="measures the weights only"):
        diagnostics.advise(lambda x: x.sum(), x, levels=("128x128",))


# --- in training --------------------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(256, name="up")(x))
        h = nn.Dense(128, name="down")(h) * 1e4  # a large output gradient for "up" below
        return nn.Dense(8, name="head")(h)


def _advice(model, budget=0.01, levels=("tensor", "128x128", "1x128", "mx32")):
    x = jnp.asarray(outlier_in_rows()[:32, :128])
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    advice = diagnostics.advise(loss, params, x, levels=levels, underflow_budget=budget)
    return advice, params, x


def test_advise_table_and_its_mapping_through_quantize_model():
    model = mxl.quantize_model(MLP())  # head stays in high precision: no jaxmx GEMM
    advice, params, x = _advice(model, budget=0.05, levels=("tensor", "128x128", "mx32"))
    assert list(advice) == ["up", "down"]
    for name, layer in advice.items():
        assert list(layer.legs) == ["lhs", "rhs", "dgrad", "wgrad"], name
        assert "128x128" in layer.legs["rhs"].names and "128x128" not in layer.legs["lhs"].names
        levels = [g.recommendation.level for g in layer.legs.values()]
        assert layer.level == max(levels, key=diagnostics.LEVELS.index)
    # 4 of its 32 input rows hold an outlier: 12% underflow per tensor, 3% in 32-blocks
    assert advice["up"].legs["lhs"].recommendation.level == "mx32"
    table = str(advice)
    assert all(name in table for name in advice) and "wgrad" in table
    assert np.isfinite(advice.loss)

    mapping = diagnostics.advised_recipes(advice)
    assert mapping == {name: diagnostics.LEVEL_RECIPES[advice[name].level] for name in advice}
    advised = mxl.quantize_model(MLP(), recipe=mapping)
    report = mxl.conversion_report(advised, x)
    for name in advice:
        assert report[name].recipe == mapping[name]
        assert report[name].reason == f"converted: recipe pattern {name!r}"
    assert report["head"].recipe is None
    assert advised.apply(params, x).shape == (32, 8)


def test_advised_recipes_names_missing_level():
    layer = diagnostics.LayerAdvice(name="blocks/0/up", legs={}, level="tensor", reason="")
    with pytest.raises(ValueError, match=r"no recipe for level\(s\) \['tensor'\].*blocks/0/up"):
        diagnostics.advised_recipes({"blocks/0/up": layer}, {"mx32": jaxmx.recipes.MXFP8})
    twice = {
        "up": layer,
        "up#1": diagnostics.LayerAdvice(name="up#1", legs={}, level="mx32", reason=""),
    }
    assert diagnostics.advised_recipes(twice) == {"up": jaxmx.recipes.MXFP8}  # the finest
    products = {  # an attention layer's two products name the layer, at the finer level
        f"blk/attn/{p}": diagnostics.LayerAdvice(name=f"blk/attn/{p}", legs={}, level=lv, reason="")
        for p, lv in (("qk", "tensor"), ("pv", "mx32"))
    }
    assert diagnostics.advised_recipes(products) == {"blk/attn": jaxmx.recipes.MXFP8}


def test_recipe_mapping_errors():
    x = jnp.ones((2, 128))
    unmatched_pattern = mxl.quantize_model(MLP(), recipe={"up": None, "down": None, "nope": None})
    with pytest.raises(ValueError, match=r"recipe pattern\(s\) \['nope'\] match no converted"):
        mxl.conversion_report(unmatched_pattern, x)
    unmatched_layer = mxl.quantize_model(MLP(), recipe={"up": jaxmx.recipes.MXFP8})
    with pytest.raises(ValueError, match=r"\['down'\] match no pattern.*'\*'"):
        mxl.conversion_report(unmatched_layer, x)
    with pytest.raises(TypeError, match=r"recipe\['up'\] must be a jaxmx.Recipe"):
        mxl.quantize_model(MLP(), recipe={"up": "mxfp8"})
    default = mxl.quantize_model(MLP(), recipe={"up": jaxmx.recipes.NVFP4, "*": None})
    report = mxl.conversion_report(default, x)
    assert report["up"].recipe == jaxmx.recipes.NVFP4 and report["down"].recipe is None
