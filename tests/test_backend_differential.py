"""Every GEMM backend on the hard inputs of tests/hard_gemm_inputs.py, against a float64 reference.

Per backend, format pair and case the answer is one of: within docs/native.md's differential
bound of the exact result (and, for ``backend="xla"``, equal to the emulation bit for bit), or
refused up front with an error naming what it does not take (:data:`REFUSED`). The backends:
``emulate``, ``xla`` (``lax.scaled_dot``) and ``ffi`` (the C++ CPU handler here; cuBLASLt in
tests/gpu/test_gpu_differential.py). Block FP8 runs through the dispatcher as the training GEMM
does (``scale_mode="pow2"``: ``FP8_BLOCK_POW2``'s kernels; float32 scales: ``DEEPSEEK_FP8``'s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hard_gemm_inputs import (
    MX_GROUPS,
    block_group,
    decode,
    mx_group,
    problems,
    same_bits,
    ulp_distance,
)

import jaxmx
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.kernels import execute
from jaxmx._src.training.contract import gemm

BACKENDS = ("emulate", "xla", "ffi")
MX_PAIRS = (
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp8_e4m3", "mxfp4"),
    ("mxfp4", "mxfp4"),
    ("mxfp6_e2m3", "mxfp6_e3m2"),
    ("mxint8", "mxint8"),
)
BLOCK_PAIRS = (("fp8_e4m3_block", "fp8_e4m3_block"), ("fp8_e5m2_block", "fp8_e4m3_block"))

# (backend, formats or scale_mode) -> the words the refusal must contain
REFUSED = {
    ("xla", ("mxfp6_e2m3", "mxfp6_e3m2")): "mxfp6",
    ("xla", ("mxint8", "mxint8")): "mxint8",
    ("ffi", ("mxfp6_e2m3", "mxfp6_e3m2")): "mxfp6_e2m3 has no native GEMM",
    ("ffi", ("mxint8", "mxint8")): "mxint8 has no native GEMM",
    ("ffi", ("mxfp8_e5m2", "mxfp8_e5m2")): "E5M2",
    ("ffi", ("mxfp8_e4m3", "mxfp4")): "does not support",
    ("xla", "fp32"): "float32",
}


def _ids(pairs):
    return ["x".join(p) for p in pairs]


@functools.cache
def _gemm(backend: str, formats: tuple[str, str], scale_mode: str | None):
    chosen = kernels(Gemm(formats=formats, backend=backend, scale_mode=scale_mode))
    return jax.jit(lambda a, b: execute(chosen, a, b, jnp.float32))


def outcome(backend, a, b, scale_mode=None):
    """The float32 result of ``backend`` (numpy), or the exception it was refused with."""
    try:
        return np.asarray(_gemm(backend, (a.fmt, b.fmt), scale_mode)(a, b))
    except (ValueError, NotImplementedError) as error:
        return error


@functools.cache
def mx_outcomes(formats, group):
    names, a, b, x, y = mx_group(formats, group)
    return names, x, y, {backend: outcome(backend, a, b) for backend in BACKENDS}


@functools.cache
def block_outcomes(formats, pow2):
    names, a, b, x, y = block_group(formats, pow2)
    mode = "pow2" if pow2 else "fp32"
    return names, x, y, {backend: outcome(backend, a, b, mode) for backend in BACKENDS}


def assert_taken_or_refused(
    result, refusal, names, x, y, what, decodes_to_float32=False, partial_overflow=False
):
    if refusal is not None:
        assert isinstance(result, Exception), f"{what}: expected a refusal ({refusal}), ran"
        assert refusal.lower() in str(result).lower(), f"{what}: refused with {result}"
        return
    assert not isinstance(result, Exception), f"{what}: refused: {result}"
    bad = problems(result, x, y, names, decodes_to_float32, partial_overflow=partial_overflow)
    assert not bad, f"{what}: {len(bad)} entries off the bound:\n" + "\n".join(bad[:12])


@pytest.mark.parametrize("group", list(MX_GROUPS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("formats", MX_PAIRS, ids=_ids(MX_PAIRS))
def test_mx_backends_are_exact_or_refuse(formats, backend, group):
    names, x, y, results = mx_outcomes(formats, group)
    refusal = REFUSED.get((backend, formats))
    # the C++ handler sums the blocks in float32 as they come: its partial sums may overflow
    partial = backend == "ffi"
    assert_taken_or_refused(
        results[backend], refusal, names, x, y, f"{backend} {formats}", False, partial
    )


@pytest.mark.parametrize("group", list(MX_GROUPS))
@pytest.mark.parametrize("formats", MX_PAIRS[:5], ids=_ids(MX_PAIRS[:5]))
def test_xla_equals_the_emulation_bit_for_bit(formats, group):
    names, _, _, results = mx_outcomes(formats, group)
    equal = same_bits(results["xla"], results["emulate"])
    differ = sorted({names[i] for i in np.argwhere(~equal)[:, 0]})
    assert equal.all(), f"xla differs from the emulation in {differ}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("formats", BLOCK_PAIRS, ids=_ids(BLOCK_PAIRS))
def test_block_fp8_backends_are_exact_or_refuse(formats, pow2, backend):
    names, x, y, results = block_outcomes(formats, pow2)
    refusal = REFUSED.get((backend, "pow2" if pow2 else "fp32"))
    # the dequantized emulation (float32 scales) and the native block-FP8 GEMM decode to float32
    decodes = backend == "ffi" or (backend == "emulate" and not pow2)
    what = f"{backend} {formats}"
    assert_taken_or_refused(results[backend], refusal, names, x, y, what, decodes, decodes)


@pytest.mark.parametrize("formats", BLOCK_PAIRS, ids=_ids(BLOCK_PAIRS))
def test_pow2_block_fp8_xla_equals_the_emulation_bit_for_bit(formats):
    names, _, _, results = block_outcomes(formats, True)
    equal = same_bits(results["xla"], results["emulate"])
    differ = sorted({names[i] for i in np.argwhere(~equal)[:, 0]})
    assert equal.all(), f"FP8_BLOCK_POW2 under xla differs from the emulation in {differ}"


def test_the_cpu_handler_differs_from_the_emulation_within_the_bound_only():
    """Where the C++ handler and the emulation differ (summation order), both are within the
    bound (the tests above); printed: how far apart they are, in float32 ulps (-s)."""
    worst = {}
    for formats in BLOCK_PAIRS:
        for pow2 in (True, False):
            _, _, _, results = block_outcomes(formats, pow2)
            d = ulp_distance(results["ffi"], results["emulate"])
            worst[("x".join(formats), pow2)] = float(np.nanmax(d[np.isfinite(d)], initial=0))
    for formats in MX_PAIRS[:5]:
        if ("ffi", formats) in REFUSED:
            continue
        for group in MX_GROUPS:
            _, _, _, results = mx_outcomes(formats, group)
            d = ulp_distance(results["ffi"], results["emulate"])
            worst[("x".join(formats), group)] = float(np.nanmax(d[np.isfinite(d)], initial=0))
    print("ffi vs emulate, worst ulps:", worst)
    assert all(np.isfinite(v) for v in worst.values())


def _pow2_step(backend):
    recipe = jaxmx.recipes.FP8_BLOCK_POW2.replace(backend=backend)
    dims = (((1,), (1,)), ((), ()))

    def loss(x, w):
        return jaxmx.dot_general(x, w, dims, recipe=recipe, preferred_element_type=jnp.float32)

    def step(x, w, g):
        y, vjp = jax.vjp(loss, x, w)
        return (y, *vjp(g))

    return jax.jit(step)


def test_fp8_block_pow2_training_gemms_under_xla_equal_the_emulation_on_extreme_inputs():
    """Forward, dgrad and wgrad of ``FP8_BLOCK_POW2`` on inputs near float32's maximum and
    far below it (blocks quantized to scales of ``2^127`` and ``2^-127``), with cancelling
    signs: ``xla`` gives the emulation's bits (NaN, signed infinities and zeros included), and
    the emulation's finite outputs are the float64 product of the quantized operands."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[0, :128] *= 3.0e38 / np.abs(x[0, :128]).max()  # a block at float32's maximum
    x[1, 128:] *= 1.0e-37  # a block near the bottom of the range
    x[2] = 0.0
    x[2, 5] = -0.0
    w = rng.standard_normal((8, 256)).astype(np.float32)
    w[3, :128] *= 1.0e30
    w[5, 128:] *= 1.0e-30
    g = rng.standard_normal((4, 8)).astype(np.float32)
    g[1, 2] = 3.0e38
    g[3, :] = -0.0
    emulated = _pow2_step("emulate")(x, w, g)
    by_xla = _pow2_step("xla")(x, w, g)
    for name, e, o in zip(("forward", "dgrad", "wgrad"), emulated, by_xla, strict=True):
        equal = same_bits(o, e)
        assert equal.all(), f"{name}: xla differs at {np.argwhere(~equal)[:4].tolist()}"
    xq = jaxmx.quantize(jnp.asarray(x), "fp8_e4m3_block", scale_mode="pow2")
    wq = jaxmx.quantize(jnp.asarray(w), "fp8_e4m3_block", scale_mode="pow2", tile=(128, 128))
    names = ["forward"]
    bad = problems(
        np.asarray(emulated[0])[None],
        decode(xq)[None],
        decode(wq)[None],
        names,
        partial_overflow=False,
    )
    assert not bad, bad[:4]


@functools.cache
def _training_gemm(formats: tuple[str, str], exact_emulation: bool):
    recipe = jaxmx.Recipe(
        fwd=formats[0], grad=formats[1], backend="emulate", exact_emulation=exact_emulation
    )
    return jax.jit(lambda a, b: gemm(recipe, a, b, jnp.float32))


@pytest.mark.parametrize("formats", MX_PAIRS, ids=_ids(MX_PAIRS))
def test_training_gemms_with_exact_emulation_are_exact(formats):
    """The training GEMM (the runner ``dot_general``, ``fsdp_dot_general`` and the expert path
    call) of a recipe with ``exact_emulation=True`` on the cases whose scales span wide
    (compensating across the operands, full range, a dominant block deep in its row): within
    the bound, as ``jaxmx.matmul``."""
    names, a, b, x, y = mx_group(formats, "wide")
    result = np.asarray(_training_gemm(formats, True)(a, b))
    bad = problems(result, x, y, names, partial_overflow=False)
    assert not bad, f"{len(bad)} entries off the bound:\n" + "\n".join(bad[:12])


def test_the_training_frame_alone_loses_compensating_scales():
    """Without ``exact_emulation`` the training GEMM keeps the row-relative frame, which loses
    the products of compensating scales (the exception docs/native.md states)."""
    names, a, b, x, y = mx_group(("mxfp8_e4m3", "mxfp8_e4m3"), "wide")
    result = np.asarray(_training_gemm(("mxfp8_e4m3", "mxfp8_e4m3"), False)(a, b))
    bad = problems(result, x, y, names, partial_overflow=False)
    assert any(line.startswith("compensating") for line in bad), bad[:4]


def test_dot_general_with_exact_emulation_keeps_compensating_products():
    """End to end: ``jaxmx.dot_general`` of rows whose blocks sit at ``2^73`` and ``2^-67``
    against rows at ``2^-67`` and ``2^73`` (each block ``2^h`` once and ``2^(h-8)``, exact in
    E4M3): the float64 product with ``exact_emulation``, none of it without; and so does
    ``jaxmx.fsdp_dot_general`` over two devices."""

    def row(high, low):
        blocks = [np.full(32, 2.0 ** (e - 8)) for e in (high, low)]
        blocks[0][0], blocks[1][0] = 2.0**high, 2.0**low
        return np.concatenate(blocks)

    x = np.stack([row(73, -67)] * 2).astype(np.float32)
    w = np.stack([row(-67, 73)] * 64).astype(np.float32)
    want = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)  # 128.0605...
    dims = (((1,), (1,)), ((), ()))
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    for exact, expected in ((True, want), (False, np.zeros_like(want))):
        recipe = jaxmx.recipes.MXFP8.replace(backend="emulate", exact_emulation=exact)
        got = jaxmx.dot_general(jnp.asarray(x), jnp.asarray(w), dims, recipe=recipe)
        np.testing.assert_array_equal(np.asarray(got), expected)

        def layer(x, w, recipe=recipe):
            return jaxmx.fsdp_dot_general(
                x, w, dims, axis_name="fsdp", gather_axis=0, recipe=recipe
            )

        spec = jax.sharding.PartitionSpec("fsdp")
        sharded = jax.shard_map(layer, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        np.testing.assert_array_equal(np.asarray(sharded(x, w)), expected, err_msg="fsdp")
