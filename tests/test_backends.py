"""Backend selection: "auto" is resolved per lowering platform, never from the host's default."""

import jax
import jax.numpy as jnp
import pytest

import jaxmx
from jaxmx._src.gemm import backends

TN = (((1,), (1,)), ((), ()))


@pytest.fixture
def capable_gpu(monkeypatch):
    """A host whose CUDA device runs cuBLASLt MX GEMMs (the report says so)."""
    monkeypatch.setattr(backends, "cublaslt_supported", lambda: True)


def lowered(f, platforms, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=platforms).as_text()


def test_explicit_backends_run_everywhere():
    assert backends.per_platform("emulate", ("mxfp4",)) == {"default": "emulate"}
    assert backends.per_platform("ffi", ("mxfp8_e4m3",)) == {"default": "ffi"}


def test_auto_uses_the_native_gemm_on_cuda_only(capable_gpu):
    assert backends.per_platform("auto", ("mxfp8_e4m3", "mxfp8_e5m2")) == {
        "default": "emulate",
        "cuda": "ffi",
    }


def test_auto_never_sends_formats_without_a_native_gemm_to_it(capable_gpu):
    assert backends.per_platform("auto", ("mxfp8_e4m3", "mxfp4")) == {"default": "emulate"}
    # cuBLASLt has no E5M2 x E5M2 kernel
    assert backends.per_platform("auto", ("mxfp8_e5m2", "mxfp8_e5m2")) == {"default": "emulate"}


def test_auto_sends_block_fp8_to_cuda_where_hopper_runs_it(monkeypatch):
    monkeypatch.setattr(backends, "block_fp8_supported", lambda: True)
    monkeypatch.setattr(backends, "cublaslt_supported", lambda: False)
    block = ("fp8_e4m3_block", "fp8_e5m2_block")
    assert backends.per_platform("auto", block) == {"default": "emulate", "cuda": "ffi"}
    assert backends.per_platform("auto", ("mxfp8_e4m3",)) == {"default": "emulate"}
    # no native GEMM mixes families, and none takes E5M2 x E5M2
    assert backends.per_platform("auto", ("fp8_e4m3_block", "mxfp8_e4m3")) == {"default": "emulate"}
    assert backends.per_platform("auto", ("fp8_e5m2_block",) * 2) == {"default": "emulate"}


def test_auto_emulates_where_no_device_runs_the_native_gemm(monkeypatch):
    monkeypatch.setattr(backends, "cublaslt_supported", lambda: False)
    assert backends.per_platform("auto", ("mxfp8_e4m3",)) == {"default": "emulate"}


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        backends.per_platform("cuda", ())
    with pytest.raises(ValueError, match="unknown backend"):
        jaxmx.Recipe(backend="cublas")


@pytest.mark.cublaslt
def test_a_cpu_lowering_on_a_gpu_host_gets_the_emulation(capable_gpu):
    x, w = jnp.ones((8, 64)), jnp.ones((16, 64))

    def f(x, w):
        return jaxmx.dot_general(x, w, TN)

    cpu, cuda, both = (lowered(f, p, x, w) for p in (("cpu",), ("cuda",), ("cpu", "cuda")))
    assert "jaxmx_mx_matmul" not in cpu and "stablehlo.dot_general" in cpu
    assert "jaxmx_mx_matmul" in cuda and "stablehlo.dot_general" not in cuda
    assert "jaxmx_mx_matmul" in both and "stablehlo.dot_general" in both


def test_emulation_feeds_bfloat16_operands_on_every_platform():
    a = jaxmx.quantize(jnp.ones((8, 64)))

    def f(a):
        return jaxmx.matmul(a, a, jnp.float32, backend="emulate")

    for platform in ("cpu", "cuda"):
        text = lowered(f, (platform,), a)
        dot = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert dot and all("xbf16>, tensor" in line for line in dot), (platform, dot)


def test_the_availability_report_names_every_backend():
    report = jaxmx.backends()
    assert set(report) == {
        "emulate",
        "ffi-cpu",
        "cublaslt",
        "cublaslt-block-fp8",
        "cublaslt-fp4",
        "native-recipes",
    }
    assert report["emulate"] == "available"
    assert report["ffi-cpu"] == "available"  # the CPU handler is always built
    has_gpu = bool([d for d in jax.devices() if d.platform == "gpu"])
    if not has_gpu:
        assert report["cublaslt"] != "available"
        assert report["cublaslt-block-fp8"] != "available"
        assert report["cublaslt-fp4"] != "available"
        assert report["native-recipes"].startswith("none")


def test_the_report_names_the_recipes_each_native_gemm_runs(monkeypatch):
    monkeypatch.setattr(backends, "cublaslt_supported", lambda: False)
    monkeypatch.setattr(backends, "block_fp8_supported", lambda: True)
    assert backends.backends()["native-recipes"] == "DEEPSEEK_FP8, FP8_BLOCK_POW2 (cuBLASLt)"
    monkeypatch.setattr(backends, "cublaslt_supported", lambda: True)
    monkeypatch.setattr(backends, "block_fp8_supported", lambda: False)
    mx_gpu = "FP8_BLOCK_POW2, MXFP8, MXFP8_2D, MXFP8_HYBRID (cuBLASLt)"  # pow2 scales as MX
    assert backends.backends()["native-recipes"] == mx_gpu


def test_block_fp8_needs_hopper_and_cublaslt_12_9(monkeypatch):
    class Device:
        compute_capability = "10.0"

    monkeypatch.setattr(backends, "_cuda_device", lambda: (Device(), ""))
    backends._block_fp8_status.cache_clear()
    try:
        assert "runs on 9.x (Hopper)" in backends._block_fp8_status()
        Device.compute_capability = "9.0"
        backends._block_fp8_status.cache_clear()
        libs = {"loaded": True, "error": "", "cublaslt_version": 120805}
        ext = type("Ext", (), {"cuda_libraries": staticmethod(lambda: libs)})
        monkeypatch.setattr(backends.extension, "load", lambda: (ext, ""))
        assert "cuBLASLt 12.8 is loaded; block-FP8 scaling needs >= 12.9" in (
            backends._block_fp8_status()
        )
        libs["cublaslt_version"] = 120900
        backends._block_fp8_status.cache_clear()
        assert backends._block_fp8_status() == "available"
    finally:
        backends._block_fp8_status.cache_clear()
