"""The granularity advisor (jaxmx.diagnostics.granularity / advise / advised_recipes) and the
per-layer recipe mapping of quantize_model, against an independent numpy + ml_dtypes reference."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmx
import jaxmx.flax.linen as mxl
from jaxmx import diagnostics
from jaxmx._src.core import formats
from jaxmx._src.diagnostics import level_stats

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
    block = {"1x128": 128, "nvfp4_16": 16}.get(level) or int(level.removeprefix("mx"))
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
    elif level.startswith("mx"):  # E8M0 rceil: 2^ceil(log2(amax / elem_max))
        mant, ex = np.frexp(amax.astype(np.float64) / elem_max)
        e = np.clip(np.where(mant == 0.5, ex - 1, ex), -127, 127)  # E8M0's range
        codes = _cast((g * 2.0**-e).astype(np.float32), dtype, elem_max)
        xhat = codes * 2.0**e  # float64: an overflow of float32 shows as inf below
        xhat = xhat.astype(np.float32)
    else:  # block FP8: float32 scale amax / elem_max
        s = np.maximum(amax / np.float32(elem_max), np.float32(2.0**-126))
        codes = _cast(g / s, dtype, elem_max)
        xhat = codes * s
    return _ungroup(codes, x, level), _ungroup(xhat, x, level), g


def reference_stats(x, level, element):
    _, elem_max, emin = ELEMENTS[element]
    codes, xhat, groups = reference(x, level, element)
    nonzero = x != 0
    x64, e64 = x.astype(np.float64), (x.astype(np.float64) - xhat)
    groups = groups.astype(np.float64)
    spans = np.abs(groups).max(axis=1) / groups.std(axis=1)
    return {
        "underflow": np.mean(np.abs(codes[nonzero]) < 2.0**emin),
        "flushed": np.mean(codes[nonzero] == 0),
        "sqnr_db": 10 * np.log10(np.sum(x64**2) / np.sum(e64**2)),
        "span_max": spans.max(),
        "span_p50": np.percentile(spans, 50, method="inverted_cdf"),
        "groups": spans.size,
        "nonfinite": np.mean(~np.isfinite(xhat)),
        "saturated": np.mean(np.isinf(xhat[nonzero]) | (np.abs(codes[nonzero]) == elem_max)),
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


def test_a_format_added_to_the_table_is_a_level(monkeypatch):
    # made-up entries: MXFP8 in 16-element blocks, MXFP4 in 64-element blocks
    for base, name, block in (("mxfp8_e4m3", "mxfp8_e4m3_b16", 16), ("mxfp4", "mxfp4_b64", 64)):
        made_up = dataclasses.replace(formats.FORMATS[base], name=name, block=block)
        monkeypatch.setitem(formats.FORMATS, name, made_up)
    x = outlier_in_every_block()
    g = diagnostics.granularity(jnp.asarray(x), underflow_budget=0.2)
    assert g.names == ("tensor", "row", "128x128", "1x128", "mx32", "mx16")  # coarsest first
    assert g.recommendation.level == "mx16"  # the finest: no level keeps within 0.2
    fp4 = diagnostics.granularity(jnp.asarray(x), fmt="fp4_e2m1", levels=("mx64", "mx32"))
    assert fp4.names == ("mx64", "mx32")
    assert diagnostics.granularity(jnp.asarray(x), fmt="mxfp4").names == (
        "mx64",
        "mx32",
        "nvfp4_16",
    )
    for element, got in (("fp8_e4m3", g.levels["mx16"]), ("fp4_e2m1", fp4.levels["mx64"])):
        ref = reference_stats(x, "mx16" if element == "fp8_e4m3" else "mx64", element)
        for field in ("underflow", "flushed", "span_max", "span_p50", "groups"):
            np.testing.assert_allclose(
                float(getattr(got, field)), ref[field], rtol=1e-5, err_msg=(element, field)
            )
        np.testing.assert_allclose(float(got.sqnr_db), ref["sqnr_db"], atol=1e-3)


def test_bad_input():
    x = jnp.ones((4, 128))
    with pytest.raises(ValueError, match="unknown level"):
        diagnostics.granularity(x, levels=("1x64",))
    with pytest.raises(ValueError, match="unknown fmt 'int8'"):
        diagnostics.granularity(x, fmt="int8")
    with pytest.raises(ValueError, match="mxint8's elements are none of the element formats"):
        diagnostics.granularity(x, fmt="mxint8")  # no native GEMM takes int8 elements
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


# --- NaN, inf, subnormals, overflow: the statistics count them -------------------------------

TRUTH_LEVELS = ("tensor", "row", "1x128", "mx32")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_breaks_every_level_and_nothing_is_recommended(bad):
    x = _normal((4, 256))
    x[1, 40] = bad
    g = diagnostics.granularity(jnp.asarray(x), levels=TRUTH_LEVELS)
    for level, stats in g.levels.items():
        # numpy: every element of a group (one scale) holding the NaN / inf dequantizes to NaN
        group = {"tensor": x.size, "row": 256, "1x128": 128, "mx32": 32}[level]
        np.testing.assert_equal(float(stats.nonfinite), group / x.size, err_msg=level)
        for field in ("underflow", "flushed", "saturated", "sqnr_db", "span_max", "span_p50"):
            assert np.isnan(float(getattr(stats, field))), (level, field)
    assert g.holds_nonfinite
    rec = g.recommendation
    assert rec.level is None and "NaN or inf" in rec.reason and "tensor 100%" in rec.reason
    assert "recommendation: none" in str(g)


def test_subnormal_inputs_are_not_zeros():
    x = _normal((4, 256))
    x[:, ::2] = np.float32(1e-39)  # half of the tensor subnormal: flushed per tensor
    sub = np.full((4, 256), 1e-39, np.float32) * (1 + np.arange(256, dtype=np.float32) / 256)
    for case in (x, sub):
        g = diagnostics.granularity(jnp.asarray(case), levels=("tensor", "row", "mx32"))
        for level, stats in g.levels.items():
            ref = reference_stats(case, level, "fp8_e4m3")
            for field in ("underflow", "flushed", "span_max", "span_p50"):
                np.testing.assert_allclose(
                    float(getattr(stats, field)), ref[field], rtol=1e-5, err_msg=(level, field)
                )
            np.testing.assert_allclose(float(stats.sqnr_db), ref["sqnr_db"], atol=1e-3)
    assert float(g.levels["tensor"].flushed) == 1.0  # the all-subnormal tensor, per tensor


def test_huge_values_do_not_overflow_the_statistics():
    x = _normal((4, 256)) * np.float32(1e20)  # x^2 overflows float32
    g = diagnostics.granularity(jnp.asarray(x), levels=("tensor", "row", "mx32"))
    for level, stats in g.levels.items():
        ref = reference_stats(x, level, "fp8_e4m3")
        for field in ("span_max", "span_p50", "underflow"):
            np.testing.assert_allclose(
                float(getattr(stats, field)), ref[field], rtol=1e-5, err_msg=(level, field)
            )
        np.testing.assert_allclose(float(stats.sqnr_db), ref["sqnr_db"], atol=1e-3)
        assert float(stats.nonfinite) == 0.0


def test_a_block_that_dequantizes_to_inf_is_saturated_not_exact():
    x = np.full((1, 64), 3.4e38, np.float32)  # mx32: 3.4e38 / 2^120 rounds to 256: 2^128 = inf
    x[0, 32:] = 1.0
    g = diagnostics.granularity(jnp.asarray(x), levels=("tensor", "mx32"))
    mx = g.levels["mx32"]
    with np.errstate(over="ignore", divide="ignore"):
        ref = reference_stats(x, "mx32", "fp8_e4m3")
    assert ref["nonfinite"] == 0.5  # numpy: the first block's dequantized values are inf
    np.testing.assert_equal(float(mx.nonfinite), ref["nonfinite"])
    np.testing.assert_equal(float(mx.saturated), ref["saturated"])
    assert float(mx.sqnr_db) == -np.inf
    rec = g.recommendation  # per tensor stays finite: it is the one recommended
    assert rec.level == "tensor" and "mx32: dequantized values overflow" in rec.reason


def test_unreadable_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"x of shape \(0, 128\) is empty"):
        diagnostics.granularity(jnp.zeros((0, 128)))
    x = jnp.asarray(no_outliers())
    g = diagnostics.granularity(x, levels=("tensor",), underflow_budget=np.float32(0.01))
    assert g.recommendation.level == "tensor"
    with pytest.raises(ValueError, match="must be a number in"):
        diagnostics.granularity(x, underflow_budget="0.01")
    batch = jax.vmap(lambda x: diagnostics.granularity(x, levels=("tensor",)))(x[None])
    with pytest.raises(ValueError, match=r"statistics of shape \(1,\).*jax.vmap"):
        batch.recommend(0.01)


def test_advice_flags_a_nan_leg_and_refuses_to_map_it():
    def loss(w, x):
        with diagnostics.named("proj"):
            return (jaxmx.dot_general(x, w, (((1,), (0,)), ((), ()))) ** 2).sum()

    x, w = jax.random.normal(jax.random.key(0), (2, 32, 64))
    advice = diagnostics.advise(loss, w.T.at[3, 5].set(jnp.nan), x, levels=("tensor", "mx32"))
    assert advice.nonfinite["proj"][0] == "rhs"  # the weight; the gradients follow from it
    assert advice["proj"].level is None and "NaN or inf" in advice["proj"].reason
    assert "NaN/inf" in str(advice)
    with pytest.raises(ValueError, match=r"no level for GEMM\(s\) \{'proj'"):
        advice.recipes()


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


def test_tensors_of_many_small_shapes_share_one_program_and_their_padding_is_not_measured():
    """Rows and columns are padded to a power of two (at least 256) before measuring: tensors of
    three shapes compile one program, and their statistics are those of the tensor alone: the
    fractions and SQNR of the reference on the tensor zero-padded to whole 128-tiles (zeros
    count in none of them), and one group per scale of the tensor itself."""
    shapes = [(100, 200), (37, 129), (3, 250)]
    before = level_stats._measure._cache_size()
    for i, shape in enumerate(shapes):
        x = _normal(shape, seed=i) * np.logspace(0, 4, shape[1], dtype=np.float32)
        g = diagnostics.granularity(jnp.asarray(x), underflow_budget=0.01)
        m, n = shape
        groups = {"tensor": 1, "row": m, "128x128": 2, "1x128": m * 2, "mx32": m * -(-n // 32)}
        whole = np.pad(x, [(0, -m % 128), (0, -n % 128)])
        for level, stats in g.levels.items():
            with np.errstate(invalid="ignore"):  # the reference's spans of all-zero groups
                ref = reference_stats(whole, level, "fp8_e4m3")
            for field in ("underflow", "flushed"):
                np.testing.assert_allclose(float(getattr(stats, field)), ref[field], rtol=1e-5)
            np.testing.assert_allclose(float(stats.sqnr_db), ref["sqnr_db"], atol=1e-3)
            assert float(stats.groups) == groups[level], (shape, level)
    assert level_stats._measure._cache_size() - before <= 1  # 0: another test compiled it
