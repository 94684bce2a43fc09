"""Backend selection: "auto" is resolved per lowering platform, never from the host's default."""

import jax
import jax.numpy as jnp
import pytest
from machines import BLACKWELL, HOPPER, NO_GPU

import jaxmx
from jaxmx._src.gemm.capabilities import REQUIREMENTS, Capabilities
from jaxmx._src.gemm.dispatch import Gemm, kernels

TN = (((1,), (1,)), ((), ()))
MX_GPU = Capabilities(compute_capability=(10, 0), cublaslt_version=120800)


def plan(backend, formats, caps=NO_GPU, **fields):
    chosen = kernels(Gemm(formats=formats, backend=backend, **fields), caps)
    return {platform: kernel.name for platform, kernel in chosen.items()}


@pytest.fixture
def capable_gpu(machine):
    """A host whose CUDA device runs cuBLASLt MX GEMMs (the report says so)."""
    machine(BLACKWELL)


def lowered(f, platforms, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=platforms).as_text()


def test_explicit_backends_run_everywhere():
    assert plan("emulate", ("mxfp4", "mxfp4"), BLACKWELL) == {"default": "emulate"}
    assert plan("ffi", ("mxfp8_e4m3", "mxfp8_e4m3")) == {"default": "native"}


def test_auto_uses_the_native_gemm_on_cuda_only():
    assert plan("auto", ("mxfp8_e4m3", "mxfp8_e5m2"), BLACKWELL) == {
        "default": "emulate",
        "cuda": "native",
    }


def test_auto_never_sends_formats_without_a_native_gemm_to_it():
    assert plan("auto", ("mxfp8_e4m3", "mxfp4"), BLACKWELL) == {"default": "emulate"}
    # cuBLASLt has no E5M2 x E5M2 kernel
    assert plan("auto", ("mxfp8_e5m2", "mxfp8_e5m2"), BLACKWELL) == {"default": "emulate"}


def test_auto_sends_block_fp8_to_cuda_where_hopper_runs_it():
    block = ("fp8_e4m3_block", "fp8_e5m2_block")
    assert plan("auto", block, HOPPER) == {"default": "dequantized", "cuda": "native"}
    assert plan("auto", ("mxfp8_e4m3",) * 2, HOPPER) == {"default": "emulate"}
    # no native GEMM mixes families, and none takes E5M2 x E5M2
    assert plan("auto", ("fp8_e4m3_block", "mxfp8_e4m3"), HOPPER) == {"default": "dequantized"}
    assert plan("auto", ("fp8_e5m2_block",) * 2, HOPPER) == {"default": "dequantized"}


def test_auto_emulates_where_no_device_runs_the_native_gemm():
    assert plan("auto", ("mxfp8_e4m3",) * 2) == {"default": "emulate"}
    assert plan("auto", ("nvfp4",) * 2, HOPPER) == {"default": "emulate"}


def test_the_emulation_is_chosen_by_scale_kind_blocks_and_tiles():
    mx = ("mxfp8_e4m3", "mxfp8_e4m3")
    assert plan("emulate", mx, to_values=True) == {"default": "emulate_values"}
    # a tiled weight stays an MXArray; the other operand is quantized straight to values
    assert plan("emulate", mx, to_values=True, tiles=((32, 32), None)) == {
        "default": "emulate_values"
    }
    assert plan("emulate", mx, tiles=((32, 32), None)) == {"default": "emulate"}
    assert plan("emulate", mx, tiles=((64, 16), None)) == {"default": "dequantized"}
    nvfp4 = ("nvfp4", "nvfp4")
    assert plan("emulate", nvfp4, to_values=True) == {"default": "emulate_values"}
    assert plan("emulate", nvfp4) == {"default": "emulate"}
    assert plan("emulate", ("nvfp4", "mxfp8_e4m3")) == {"default": "dequantized"}
    limited = jaxmx.recipes.MXFP8.replace(accum_bits=14).accumulation
    assert plan("auto", mx, BLACKWELL, accumulation=limited) == {"default": "limited"}
    with pytest.raises(ValueError, match="emulation only"):
        plan("ffi", mx, accumulation=limited)


def test_pow2_block_fp8_runs_as_its_mx_twin_where_only_the_mx_gemm_runs():
    block = ("fp8_e4m3_block", "fp8_e4m3_block")
    twin = {"default": "emulate_pow2_twin", "cuda": "native_pow2_twin"}
    assert plan("auto", block, BLACKWELL, scale_mode="pow2") == twin
    assert plan("auto", block, BLACKWELL, scale_mode="fp32") == {"default": "dequantized"}
    assert plan("auto", block, HOPPER, scale_mode="pow2")["cuda"] == "native"


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        plan("cuda", ("mxfp8_e4m3",) * 2)
    with pytest.raises(ValueError, match="unknown backend"):
        jaxmx.Recipe(backend="cublas")


@pytest.mark.cublaslt
def test_a_cpu_lowering_on_a_gpu_host_gets_the_emulation(capable_gpu):
    x, w = jnp.ones((8, 64)), jnp.ones((16, 64))

    def f(x, w):
        return jaxmx.dot_general(x, w, TN)

    def emulated_gemms(text: str) -> int:  # the emulation's dot, on bfloat16 decoded values
        return sum("stablehlo.dot_general" in line and "bf16" in line for line in text.split("\n"))

    cpu, cuda, both = (lowered(f, p, x, w) for p in (("cpu",), ("cuda",), ("cpu", "cuda")))
    assert "jaxmx_mx_matmul" not in cpu and emulated_gemms(cpu) > 0
    assert "jaxmx_mx_matmul" in cuda and emulated_gemms(cuda) == 0
    assert "jaxmx_mx_matmul" in both and emulated_gemms(both) > 0


def test_emulation_feeds_bfloat16_operands_on_every_platform():
    a = jaxmx.quantize(jnp.ones((8, 64)))

    def f(a):
        return jaxmx.matmul(a, a, jnp.float32, backend="emulate")

    for platform in ("cpu", "cuda"):
        text = lowered(f, (platform,), a)
        dot = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert dot and all("xbf16>, tensor" in line for line in dot), (platform, dot)


def test_a_build_without_cublaslt_says_what_was_decided_and_how_to_change_it():
    """The build info names the handlers built; without the CUDA handler, the report says that
    JAXMX_CUDA was off (no headers were looked for) and gives the commands that build it."""
    info = jaxmx.ffi.build_info()
    assert info["handlers"][0] == "cpu" and info["has_cuda"] == ("cuda" in info["handlers"])
    if info["has_cuda"]:
        pytest.skip("this build has the cuBLASLt handler (JAXMX_CUDA=ON)")
    assert info["handlers"] == ("cpu",)
    for key in ("cublaslt", "cublaslt-block-fp8", "cublaslt-fp4"):
        why = jaxmx.backends()[key]
        assert "JAXMX_CUDA was not ON" in why and "no CUDA headers" not in why, why
        assert "pip install nvidia-cublas nvidia-cuda-runtime" in why
        assert "JAXMX_CUDA=ON pip install -e ." in why
    assert info["cuda"] == jaxmx.backends()["cublaslt"]


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


def test_the_report_names_the_recipes_each_native_gemm_runs(machine):
    machine(HOPPER)
    hopper = (  # block FP8, per-tensor and per-row FP8
        "DEEPSEEK_FP8, FP8_BLOCK_POW2, FP8_ROWWISE, FP8_ROWWISE_GW_HP, FP8_TENSORWISE (cuBLASLt)"
    )
    assert jaxmx.backends()["native-recipes"] == hopper
    assert jaxmx.backends()["cublaslt-block-fp8"] == "available"
    machine(BLACKWELL)
    mx_gpu = (  # pow2 block scales as MX; per-tensor and per-row FP8
        "FP8_BLOCK_POW2, FP8_ROWWISE, FP8_ROWWISE_GW_HP, FP8_TENSORWISE, MXFP4, MXFP8, "
        "MXFP8_2D, MXFP8_HYBRID, NVFP4 (cuBLASLt)"
    )
    assert jaxmx.backends()["native-recipes"] == mx_gpu


def test_block_fp8_needs_hopper_and_cublaslt_12_9():
    def status(cc, version):
        return Capabilities(compute_capability=cc, cublaslt_version=version).status("block_fp8")

    assert "runs on 9.x (Hopper)" in status((10, 0), 120900)
    assert "cuBLASLt 12.8 is loaded; block-FP8 scaling" in status((9, 0), 120805)
    assert "needs >= 12.9" in status((9, 0), 120805)
    assert status((9, 0), 120900) == "available"


def test_fp4_and_mx_need_blackwell_and_cublaslt_12_8():
    for gemm, what in (("fp4", "FP4 block scaling (NVFP4 / MXFP4)"), ("mx", "MX block scaling")):
        hopper = Capabilities(compute_capability=(9, 0), cublaslt_version=120900)
        assert hopper.status(gemm) == f"device has compute capability 9.0; {what} needs >= 10.0"
        old = Capabilities(compute_capability=(10, 0), cublaslt_version=120705)
        assert old.status(gemm) == f"cuBLASLt 12.7 is loaded; {what} needs >= 12.8"
        assert BLACKWELL.status(gemm) == "available"


def test_per_tensor_fp8_needs_ada_or_later():
    ampere = Capabilities(compute_capability=(8, 6), cublaslt_version=120900)
    assert ampere.status("fp8") == "device has compute capability 8.6; per-tensor FP8 needs >= 8.9"
    assert HOPPER.supports("fp8") and BLACKWELL.supports("fp8")


def test_without_a_device_or_cublaslt_every_native_gemm_says_why():
    unloaded = Capabilities(compute_capability=(10, 0), cublaslt_error="libcublasLt.so.13: missing")
    for gemm in REQUIREMENTS:
        assert NO_GPU.status(gemm) == "no CUDA GPU"
    for gemm in ("mx", "fp4", "fp8"):  # the device would run them: the library is the problem
        assert unloaded.status(gemm) == "libcublasLt.so.13: missing"
    assert "runs on 9.x" in unloaded.status("block_fp8")  # the device comes first


def test_assume_takes_only_capabilities():
    with pytest.raises(TypeError, match="Capabilities"):
        with jaxmx._src.gemm.capabilities.assume((10, 0)):
            pass


def test_grouped_gemms_are_emulated_everywhere_and_refuse_ffi():
    mx = ("mxfp8_e4m3", "mxfp8_e4m3")
    assert plan("auto", mx, BLACKWELL, grouped=True) == {"default": "dequantized"}
    with pytest.raises(NotImplementedError, match="no native grouped MX GEMM"):
        plan("ffi", mx, grouped=True)
