"""The CUDA handler's core (ffi/cublaslt_gemm.cc) against a cuBLASLt test double, without a GPU.

The core is compiled here with tests/cublaslt_double.cc (host memory standing in for device
memory; see its header for the cuBLASLt behaviour it implements and refuses) into a shared
library loaded with ctypes. Results are compared with a numpy + ml_dtypes reference written here:
codes decoded by ml_dtypes, scales as 2.0 ** (byte - 127), float64 GEMMs; the swizzled scale
layout comes from ``swizzle`` in tests/reference.py.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest
import reference as ref

from jaxmx import _ffi, ffi

pytestmark = pytest.mark.cublaslt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODES = ["ok", "invalid_argument", "failed_precondition", "unimplemented", "internal"]  # LtCode
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
OUT = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
OUT_EPS = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
OUT_TINY = {"float32": 0.0, "bfloat16": 2.0**-133, "float16": 2.0**-24}
# Scale bytes per output type, so that float16 results stay finite (|value| < 65504).
SCALE_BYTES = {"float32": (100, 150), "bfloat16": (90, 160), "float16": (100, 112)}


class MatmulRecord(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_int64),
        ("workspace", ctypes.c_uint64),
        ("workspace_bytes", ctypes.c_uint64),
        ("batch_count", ctypes.c_int64),
        ("transa", ctypes.c_int64),
        ("transb", ctypes.c_int64),
        ("fast_accum", ctypes.c_int64),
        ("alpha_vector_batch_stride", ctypes.c_int64),
        ("a_scale_mode", ctypes.c_int64),
        ("b_scale_mode", ctypes.c_int64),
        ("pointer_mode", ctypes.c_int64),
        ("alpha", ctypes.c_double),
    ]


def build(directory, core_includes=()) -> ctypes.CDLL:
    """The core + the double as a shared library in `directory`, built with the extension's CUDA
    headers; `core_includes` go first on the core's include path (the double never sees them)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert compiler, "no C++ compiler (g++ / c++ / $CXX) to build the cuBLASLt test double"
    includes = _ffi.build_info()["cuda_include_dirs"].split(os.pathsep)
    flags = [compiler, "-std=c++17", "-O2", "-fPIC", "-Wall", "-I", os.path.join(ROOT, "ffi")]
    flags += [f"-isystem{d}" for d in includes]
    objects = []
    for source, extra in (
        ("ffi/cublaslt_gemm.cc", core_includes),
        ("tests/cublaslt_double.cc", ()),
    ):
        obj = os.path.join(directory, os.path.basename(source) + ".o")
        cmd = [*flags[:1], *(f"-I{d}" for d in extra), *flags[1:], "-c"]
        cmd += [os.path.join(ROOT, source), "-o", obj]
        built = subprocess.run(cmd, capture_output=True, text=True)
        assert built.returncode == 0, f"{' '.join(cmd)}\n{built.stderr}"
        objects.append(obj)
    so = os.path.join(directory, "libcublaslt_double.so")
    linked = subprocess.run(
        [compiler, "-shared", *objects, "-o", so], capture_output=True, text=True
    )
    assert linked.returncode == 0, linked.stderr
    lib = ctypes.CDLL(so)
    p, i, i64, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_char_p
    lib.double_reset.argtypes = [i, ctypes.POINTER(i), i]
    lib.double_refusal.restype = s
    lib.double_handle_devices.argtypes = [ctypes.POINTER(i), i]
    lib.double_matmul.argtypes = [i, ctypes.POINTER(MatmulRecord)]
    lib.core_new.restype = p
    lib.core_free.argtypes = [p]
    lib.core_gemm.argtypes = [p, i, i, i, i64, i64, i64, i64, s, s, s, p, p, p, p, p, i, p]
    lib.core_gemm.argtypes += [ctypes.c_uint64, s, i, p, i, i]
    lib.double_plain_matmul.argtypes = [i64, i64, i64, s, s, i, i, i, ctypes.c_uint64]
    lib.double_plain_matmul.restype = s
    return lib


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("cublaslt_double")))


def plain_matmul(lib, m, n, k, types, trans=(1, 0), mx=True, workspace_offset=0, scaling=None):
    """Status name of a plain cuBLASLt user of the double (no core): op(A) [m, k] op(B) [k, n]
    with `trans` = (transa, transb); `scaling` (default: 1 if `mx` else 0) as in
    double_plain_matmul."""
    scaling = int(mx) if scaling is None else scaling
    status = lib.double_plain_matmul(
        m, n, k, types[0].encode(), types[1].encode(), *trans, scaling, workspace_offset
    )
    return status.decode()


def aligned(nbytes: int, offset: int = 0) -> np.ndarray:
    """uint8 host buffer whose address is `offset` bytes past a 256-byte boundary."""
    raw = np.zeros(nbytes + 512, np.uint8)
    start = (offset - raw.ctypes.data) % 256
    view = raw[start : start + nbytes]
    assert view.ctypes.data % 256 == offset
    return view


def placed(a: np.ndarray, offset: int = 0) -> np.ndarray:
    """A copy of `a` at `offset` bytes past a 256-byte boundary."""
    buf = aligned(a.nbytes, offset)
    buf[:] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    return buf.view(a.dtype).reshape(a.shape)


class Machine:
    """The double's simulated GPUs with one core context on them."""

    def __init__(self, lib, capabilities=(100,), cublaslt_version=130100):
        self.lib = lib
        ccs = (ctypes.c_int * len(capabilities))(*capabilities)
        lib.double_reset(len(capabilities), ccs, cublaslt_version)
        self.context = lib.core_new()

    def close(self):
        self.lib.core_free(self.context)

    def gemm(
        self,
        lhs,
        rhs,
        lhs_scale,
        rhs_scale,
        out,
        *,
        mx,
        device=0,
        fast_accum=False,
        workspace=None,
        prepare_only=False,
        tiles=None,
        fp4=None,
        alpha_beta=None,
        types=None,
        k_first=(False, False),
    ):
        """(LtCode name, message) of the core on these host buffers ([B, M, K], [B, N, K]).

        ``tiles``: None (``mx`` says MX or per-tensor), else a block-FP8 call with 128x128 tiles
        for ``"rhs"``, ``"lhs"``, ``"both"`` or ``""`` (1x128 blocks on both sides). ``fp4``:
        ``"nvfp4"`` or ``"mxfp4"``: packed E2M1 operands ([B, M, K/2], [B, N, K/2] bytes) with
        those scales and ``alpha_beta`` (float32 [B, 2], or None: a null pointer); ``types``
        overrides the operand type names. ``k_first``: (lhs, rhs) flags of operands stored
        [B, K, rows] instead."""
        scaling = int(mx) if tiles is None else {"": 2, "rhs": 3, "lhs": 4, "both": 5}[tiles]
        batch, m, k = lhs.shape
        if k_first[0]:
            k, m = m, k
        n = rhs.shape[2 if k_first[1] else 1]
        if fp4 is not None:
            scaling, k = {"nvfp4": 6, "mxfp4": 1}[fp4], 2 * k
            types = types or ("float4_e2m1fn", "float4_e2m1fn")
        types = types or (lhs.dtype.name, rhs.dtype.name)
        workspace = aligned(ffi.WORKSPACE_BYTES + 256) if workspace is None else workspace
        message = ctypes.create_string_buffer(1024)
        code = self.lib.core_gemm(
            self.context, int(prepare_only), device, scaling, batch, m, n, k,
            types[0].encode(), types[1].encode(), out.dtype.name.encode(),
            lhs.ctypes.data, rhs.ctypes.data, lhs_scale.ctypes.data, rhs_scale.ctypes.data,
            out.ctypes.data, int(fast_accum), workspace.ctypes.data, workspace.nbytes,
            message, len(message), None if alpha_beta is None else alpha_beta.ctypes.data,
            int(k_first[0]), int(k_first[1]),
        )  # fmt: skip
        return CODES[code], message.value.decode()

    def matmuls(self) -> list[MatmulRecord]:
        records = []
        for i in range(self.lib.double_matmul_count()):
            r = MatmulRecord()
            self.lib.double_matmul(i, ctypes.byref(r))
            records.append(r)
        return records

    def handle_devices(self) -> list[int]:
        out = (ctypes.c_int * 16)()
        return list(out[: self.lib.double_handle_devices(out, 16)])

    def refusal(self) -> str:
        return self.lib.double_refusal().decode()


@pytest.fixture
def machine(lib):
    made = []

    def make(capabilities=(100,), cublaslt_version=130100):
        made.append(Machine(lib, capabilities, cublaslt_version))
        return made[-1]

    yield make
    for m in made:
        m.close()


# --- operands and the reference -------------------------------------------------------------------


def random_codes(rng, shape, dtype):
    """Random finite codes of an fp8 type (every finite code can occur)."""
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    finite = np.isfinite(codes.view(FP8[dtype]).astype(np.float32))
    return np.where(finite, codes, 0).astype(np.uint8).view(FP8[dtype])


def swizzled(scales: np.ndarray) -> np.ndarray:
    """[B, rows, K/32] scale bytes -> the B swizzled buffers one after the other."""
    return np.concatenate([ref.swizzle(s) for s in scales])


def assert_close(out, exact, abs_sum, k, out_dtype):
    """|out - exact| within float32 summation over the K-blocks plus the output rounding."""
    out = np.asarray(out).astype(np.float64)
    blocks = -(-k // 32)
    tol = (blocks + 2) * 2.0**-24 * abs_sum + OUT_EPS[out_dtype] * np.abs(exact)
    tol += OUT_TINY[out_dtype] + blocks * 2.0**-149
    bad = ~(np.abs(out - exact) <= tol)
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} entries off: {out[bad][:4]} vs {exact[bad][:4]}"
    )


def mx_case(seed, batch, m, n, k, types, byte_range=(112, 142)):
    """Operands, swizzled scales and the float64 reference of an MX GEMM."""
    rng = np.random.default_rng(seed)
    a = random_codes(rng, (batch, m, k), types[0])
    b = random_codes(rng, (batch, n, k), types[1])
    # per-row and per-block exponent variation on both sides
    sa = rng.integers(*byte_range, (batch, m, k // 32), dtype=np.uint8)
    sb = rng.integers(*byte_range, (batch, n, k // 32), dtype=np.uint8)
    x = a.astype(np.float64) * np.repeat(2.0 ** (sa.astype(np.float64) - 127), 32, axis=-1)
    y = b.astype(np.float64) * np.repeat(2.0 ** (sb.astype(np.float64) - 127), 32, axis=-1)
    exact = np.einsum("bmk,bnk->bmn", x, y)
    abs_sum = np.einsum("bmk,bnk->bmn", abs(x), abs(y))
    return (placed(a), placed(b), placed(swizzled(sa)), placed(swizzled(sb))), exact, abs_sum


# --- numerics -------------------------------------------------------------------------------------

MX_CASES = [  # (batch, M, N, K, lhs, rhs, out)
    (1, 1, 16, 32, "float8_e4m3fn", "float8_e4m3fn", "float32"),
    (1, 130, 48, 96, "float8_e4m3fn", "float8_e5m2", "bfloat16"),
    (1, 7, 144, 160, "float8_e5m2", "float8_e4m3fn", "float16"),
    (3, 33, 16, 64, "float8_e4m3fn", "float8_e4m3fn", "float32"),
    (2, 129, 32, 288, "float8_e5m2", "float8_e4m3fn", "bfloat16"),
]


@pytest.mark.parametrize("batch,m,n,k,lhs,rhs,out", MX_CASES)
def test_mx_gemm_matches_numpy_in_one_strided_batched_call(machine, batch, m, n, k, lhs, rhs, out):
    gpu = machine()
    case = mx_case(m * n + k, batch, m, n, k, (lhs, rhs), SCALE_BYTES[out])
    (a, b, sa, sb), exact, abs_sum = case
    d = placed(np.full((batch, m, n), np.nan, OUT[out]))
    assert gpu.gemm(a, b, sa, sb, d, mx=True) == ("ok", "")
    assert_close(d, exact, abs_sum, k, out)
    (call,) = gpu.matmuls()  # one cublasLtMatmul whatever the batch
    assert call.batch_count == batch
    assert (call.transa, call.transb) == (1, 0)  # CUBLAS_OP_T, CUBLAS_OP_N: TN on every arch


def test_mx_nan_scale_gives_nan_in_its_row_only(machine):
    gpu = machine()
    (a, b, _, sb), _, _ = mx_case(1, 1, 4, 16, 64, ("float8_e4m3fn", "float8_e4m3fn"))
    compact = np.full((1, 4, 2), 127, np.uint8)
    compact[0, 2, 1] = 0xFF
    sa = placed(swizzled(compact))
    d = placed(np.zeros((1, 4, 16), np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=True)[0] == "ok"
    assert np.isnan(d[0, 2]).all() and np.isfinite(d[0, [0, 1, 3]]).all()


@pytest.mark.parametrize("batch", [1, 3])
def test_per_tensor_gemm_matches_numpy(machine, batch):
    """One float32 scale per operand and batch element: cuBLASLt's SCALAR_32F scales a whole
    call, so a batched call is one cublasLtMatmul per batch element, each with its scales."""
    gpu = machine((90,))
    rng = np.random.default_rng(batch)
    m, n, k = 20, 32, 48
    a = placed(random_codes(rng, (batch, m, k), "float8_e4m3fn"))
    b = placed(random_codes(rng, (batch, n, k), "float8_e5m2"))
    sa = placed(np.float32([0.5, 2.0**-3, 3.0][:batch]))
    sb = placed(np.float32([0.75, 2.0, 2.0**-7][:batch]))
    d = placed(np.full((batch, m, n), np.nan, ml_dtypes.bfloat16))
    assert gpu.gemm(a, b, sa, sb, d, mx=False) == ("ok", "")
    x = a.astype(np.float64) * sa.astype(np.float64)[:, None, None]
    y = b.astype(np.float64) * sb.astype(np.float64)[:, None, None]
    exact = np.einsum("bmk,bnk->bmn", x, y)
    assert_close(d, exact, np.einsum("bmk,bnk->bmn", abs(x), abs(y)), k, "bfloat16")
    assert [c.batch_count for c in gpu.matmuls()] == [1] * batch


def test_per_tensor_scales_reach_cublaslt_16_bytes_apart(machine):
    """cuBLASLt refuses a per-tensor scale pointer that is not 16-byte aligned (an H200 did for
    4 and 8 bytes past an aligned address; the double does): the core copies each call's scales
    to slots 16 bytes apart at the end of the workspace (cuBLASLt gets the rest), and says so
    where the workspace has no room for them."""
    gpu = machine((90,))
    rng = np.random.default_rng(5)
    a = placed(random_codes(rng, (5, 16, 32), "float8_e4m3fn"))
    b = placed(random_codes(rng, (5, 16, 32), "float8_e4m3fn"))
    sa = placed(np.float32([1.0, 2.0, 4.0, 0.5, 3.0]))
    sb = placed(np.float32([0.25, 1.0, 2.0**-9, 8.0, 1.0]))
    d = placed(np.full((5, 16, 16), np.nan, np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=False) == ("ok", "")
    assert [c.workspace_bytes for c in gpu.matmuls()] == [ffi.WORKSPACE_BYTES - 256] * 5
    x = a.astype(np.float64) * sa.astype(np.float64)[:, None, None]
    y = b.astype(np.float64) * sb.astype(np.float64)[:, None, None]
    exact = np.einsum("bmk,bnk->bmn", x, y)
    assert_close(d, exact, np.einsum("bmk,bnk->bmn", abs(x), abs(y)), 32, "float32")
    code, message = gpu.gemm(a, b, sa, sb, d, mx=False, workspace=aligned(256 + 128))
    assert code == "internal" and "no room for the scale slots of a batch of 5" in message
    # one GEMM whose scales sit 4 bytes past an aligned address: copied too
    one = placed(np.full((1, 16, 16), np.nan, np.float32))
    s4 = placed(np.float32([2.0**-3]), offset=4), placed(np.float32([6.0]), offset=4)
    assert gpu.gemm(a[:1], b[:1], *s4, one, mx=False) == ("ok", "")
    x1, y1 = a[:1].astype(np.float64) * 2.0**-3, b[:1].astype(np.float64) * 6.0
    exact1 = np.einsum("bmk,bnk->bmn", x1, y1)
    assert_close(one, exact1, np.einsum("bmk,bnk->bmn", abs(x1), abs(y1)), 32, "float32")


def test_empty_contraction_writes_zeros(machine):
    gpu = machine()
    a = np.zeros((2, 3, 0), ml_dtypes.float8_e4m3fn)
    b = np.zeros((2, 16, 0), ml_dtypes.float8_e4m3fn)
    no_scales = placed(np.zeros(1, np.uint8))
    d = placed(np.full((2, 3, 16), np.nan, np.float32))
    assert gpu.gemm(a, b, no_scales, no_scales, d, mx=True) == ("ok", "")
    assert (d == 0).all() and gpu.matmuls() == []


# --- what the double refuses, and that the core never asks it -------------------------------------


def test_the_double_refuses_a_misaligned_workspace(lib, machine):
    machine()
    e4 = "float8_e4m3fn"
    assert plain_matmul(lib, 16, 16, 32, (e4, e4)) == "CUBLAS_STATUS_SUCCESS"
    status = plain_matmul(lib, 16, 16, 32, (e4, e4), workspace_offset=8)
    assert status == "CUBLAS_STATUS_INVALID_VALUE"
    assert lib.double_refusal() == b"workspace not 256-byte aligned"


@pytest.mark.parametrize("offset", [8, 16, 100, 248])
def test_the_core_hands_cublaslt_an_aligned_workspace(machine, offset):
    """XLA's workspace buffer may start anywhere: the double gets its 256-byte aligned part."""
    gpu = machine()
    (a, b, sa, sb), exact, abs_sum = mx_case(2, 1, 8, 16, 32, ("float8_e4m3fn", "float8_e5m2"))
    raw = aligned(ffi.WORKSPACE_BYTES + 256, offset)
    d = placed(np.zeros((1, 8, 16), np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=True, workspace=raw) == ("ok", "")
    (call,) = gpu.matmuls()
    assert call.workspace % 256 == 0
    assert raw.ctypes.data <= call.workspace
    assert call.workspace + call.workspace_bytes <= raw.ctypes.data + raw.nbytes
    assert call.workspace_bytes == ffi.WORKSPACE_BYTES
    assert_close(d, exact, abs_sum, 32, "float32")


def test_operands_not_16_byte_aligned_get_no_algorithm(lib, machine):
    gpu = machine()
    (a, b, sa, sb), _, _ = mx_case(3, 1, 8, 16, 32, ("float8_e4m3fn", "float8_e4m3fn"))
    d = placed(np.zeros((1, 8, 16), np.float32))
    code, message = gpu.gemm(placed(a, 8), b, sa, sb, d, mx=True)
    assert code == "unimplemented"
    assert "cuBLASLt has no algorithm for MX block-scaled" in message
    assert "alignment lhs/rhs/out 8/256/256 bytes" in message
    assert gpu.refusal() == "operands aligned to less than 16 bytes"
    assert gpu.matmuls() == []


def test_e5m2_x_e5m2_is_refused_by_the_double_and_never_asked_for(lib, machine):
    gpu = machine()
    e5 = "float8_e5m2"
    assert plain_matmul(lib, 16, 16, 32, (e5, e5)) == "CUBLAS_STATUS_NOT_SUPPORTED"
    (a, b, sa, sb), _, _ = mx_case(4, 1, 8, 16, 32, (e5, e5))
    d = placed(np.zeros((1, 8, 16), np.float32))
    code, message = gpu.gemm(a, b, sa, sb, d, mx=True)
    assert code == "unimplemented"
    assert "no float8_e5m2 x float8_e5m2 matmul" in message
    assert lib.double_heuristic_count() == 1  # the plain call's only


@pytest.mark.parametrize("cc,block_scaled", [(89, 0), (90, 0), (120, 1), (121, 1)])
def test_tn_only_architectures_refuse_other_layouts_and_the_core_uses_tn(
    lib, machine, cc, block_scaled
):
    gpu = machine((cc,))
    e4 = "float8_e4m3fn"
    for transa, transb in [(0, 0), (1, 1), (0, 1)]:
        status = plain_matmul(lib, 32, 32, 64, (e4, e4), (transa, transb), mx=bool(block_scaled))
        assert status == "CUBLAS_STATUS_NOT_SUPPORTED"
        assert gpu.refusal() == "only TN on this architecture"
    status = plain_matmul(lib, 32, 32, 64, (e4, e4), (1, 0), mx=bool(block_scaled))
    assert status == "CUBLAS_STATUS_SUCCESS"
    (a, b, sa, sb), _, _ = mx_case(5, 2, 8, 16, 64, (e4, e4))
    if not block_scaled:
        sa, sb = placed(np.float32([1.0, 2.0])), placed(np.float32([1.0, 0.5]))
    d = placed(np.zeros((2, 8, 16), np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=bool(block_scaled)) == ("ok", "")
    assert all((c.transa, c.transb) == (1, 0) for c in gpu.matmuls())


def test_sm100_has_other_layouts(lib, machine):
    machine((100,))
    e4 = "float8_e4m3fn"
    assert plain_matmul(lib, 32, 32, 64, (e4, e4), (0, 0)) == "CUBLAS_STATUS_SUCCESS"


# --- K-first (non-TN) MXFP8 operands -------------------------------------------------------------

K_FIRST = [(True, False), (False, True), (True, True)]


def k_first_case(seed, batch, m, n, k, k_first, types=("float8_e4m3fn", "float8_e4m3fn")):
    """An MX case with the codes of the K-first operands stored [B, K, rows]; the swizzled scales
    are those of the TN form (the cuBLAS scale layout is indexed by row and K-block)."""
    (a, b, sa, sb), exact, abs_sum = mx_case(seed, batch, m, n, k, types)
    a_kf = placed(a.swapaxes(1, 2)) if k_first[0] else a
    b_kf = placed(b.swapaxes(1, 2)) if k_first[1] else b
    return (a, b, sa, sb), (a_kf, b_kf), exact, abs_sum


@pytest.mark.parametrize("cc", [100, 103])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k_first", K_FIRST)
def test_sm100_runs_k_first_operands_untransposed(machine, cc, batch, k_first):
    gpu = machine((cc,))
    m, n, k = 32, 48, 96
    (a, b, sa, sb), (a_kf, b_kf), exact, abs_sum = k_first_case(batch + cc, batch, m, n, k, k_first)
    d = placed(np.full((batch, m, n), np.nan, np.float32))
    assert gpu.gemm(a_kf, b_kf, sa, sb, d, mx=True, k_first=k_first) == ("ok", "")
    assert_close(d, exact, abs_sum, k, "float32")
    (call,) = gpu.matmuls()  # still one strided-batched call
    assert call.batch_count == batch
    # A = rhs: op T in TN form, N when K-first; B = lhs: op N in TN form, T when K-first
    assert (call.transa, call.transb) == (int(not k_first[1]), int(k_first[0]))
    d_tn = placed(np.full((batch, m, n), np.nan, np.float32))
    assert gpu.gemm(a, b, sa, sb, d_tn, mx=True) == ("ok", "")
    np.testing.assert_array_equal(d, d_tn)  # the same products summed in the same order


@pytest.mark.parametrize("cc", [89, 90, 120, 121])
def test_k_first_operands_are_refused_off_compute_capability_10(lib, machine, cc):
    gpu = machine((cc,))
    (_, _, sa, sb), (a_kf, b_kf), _, _ = k_first_case(1, 1, 16, 16, 64, (True, False))
    d = placed(np.zeros((1, 16, 16), np.float32))
    code, message = gpu.gemm(a_kf, b_kf, sa, sb, d, mx=True, k_first=(True, False))
    assert code == "failed_precondition"
    assert f"compute capability {cc // 10}.{cc % 10}" in message
    assert "K-first (non-TN) operands on compute capability 10.x only" in message
    assert "TN form" in message
    assert gpu.matmuls() == [] and lib.double_heuristic_count() == 0


def test_k_first_rows_must_be_a_multiple_of_16(machine):
    gpu = machine()
    (_, _, sa, sb), (a_kf, b_kf), _, _ = k_first_case(2, 1, 8, 16, 64, (True, False))
    d = placed(np.zeros((1, 8, 16), np.float32))
    code, message = gpu.gemm(a_kf, b_kf, sa, sb, d, mx=True, k_first=(True, False))
    assert code == "invalid_argument"
    assert "lhs rows M of a K-first operand must be a multiple of 16" in message
    assert message.endswith("got 8")


def test_k_first_operands_are_for_the_mxfp8_gemm_only(machine):
    gpu = machine()
    e4 = placed(np.zeros((1, 64, 16), ml_dtypes.float8_e4m3fn))
    one = placed(np.float32([1.0]))
    d = placed(np.zeros((1, 16, 16), np.float32))
    code, message = gpu.gemm(e4, e4, one, one, d, mx=False, k_first=(False, True))
    assert code == "unimplemented"
    assert "taken by the MXFP8 GEMM only" in message and "TN form" in message
    (a, b, sa, sb), ab, _ = fp4_case(3, 1, 16, 16, 64, "mxfp4")
    code, message = gpu.gemm(
        a, b, sa, sb, d, mx=True, fp4="mxfp4", alpha_beta=ab, k_first=(False, True)
    )
    assert code == "unimplemented" and "FP4 operands must be in TN form" in message


def test_k_not_a_multiple_of_the_block(lib, machine):
    gpu = machine()
    e4 = "float8_e4m3fn"
    assert plain_matmul(lib, 16, 16, 48, (e4, e4)) == "CUBLAS_STATUS_NOT_SUPPORTED"
    assert gpu.refusal() == "K is not a multiple of the block"
    a = placed(np.zeros((1, 4, 48), np.uint8)).view(FP8[e4])
    b = placed(np.zeros((1, 16, 48), np.uint8)).view(FP8[e4])
    d = placed(np.zeros((1, 4, 16), np.float32))
    s = placed(np.zeros(1024, np.uint8))
    code, message = gpu.gemm(a, b, s, s, d, mx=True)
    assert (code, message) == ("invalid_argument", "K must be a multiple of 32 for MX block "
                               "scaling, got K = 48")  # fmt: skip


# --- the review's items: capability first, heuristic cache, fast accumulation, devices ------------


def test_an_old_gpu_is_told_about_the_gpu_before_the_cublaslt_version(machine):
    """Hopper with cuBLASLt 12.7: the capability is what rules MX out."""
    (a, b, sa, sb), _, _ = mx_case(6, 1, 8, 16, 32, ("float8_e4m3fn", "float8_e4m3fn"))
    d = placed(np.zeros((1, 8, 16), np.float32))
    code, message = machine((90,), 120700).gemm(a, b, sa, sb, d, mx=True)
    assert code == "failed_precondition"
    assert "device 0 has compute capability 9.0; MX block scaling" in message
    code, message = machine((100,), 120700).gemm(a, b, sa, sb, d, mx=True)
    assert code == "failed_precondition"
    assert message == "cuBLASLt 12.7.0 is loaded; MX block scaling needs CUDA/cuBLASLt >= 12.8"


@pytest.mark.parametrize("version,expected", [(120800, 1), (120803, 1), (120804, -1), (130100, -1)])
def test_mx_descriptors_get_a_dummy_alpha_vector_batch_stride_up_to_cublaslt_12_8_3(
    machine, version, expected
):
    gpu = machine((100,), version)
    (a, b, sa, sb), _, _ = mx_case(7, 1, 8, 16, 32, ("float8_e4m3fn", "float8_e4m3fn"))
    d = placed(np.zeros((1, 8, 16), np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=True)[0] == "ok"
    one = placed(np.float32([1.0]))
    assert gpu.gemm(a, b, one, one, d, mx=False)[0] == "ok"  # same shape, per-tensor
    mx_call, per_tensor_call = gpu.matmuls()
    assert mx_call.alpha_vector_batch_stride == expected
    assert per_tensor_call.alpha_vector_batch_stride == -1


def test_fast_accumulation_is_set_when_asked_for_per_tensor(machine):
    gpu = machine((90,))
    rng = np.random.default_rng(8)
    a = placed(random_codes(rng, (1, 8, 32), "float8_e4m3fn"))
    b = placed(random_codes(rng, (1, 16, 32), "float8_e4m3fn"))
    one = placed(np.float32([1.0]))
    d = placed(np.zeros((1, 8, 16), np.float32))
    assert gpu.gemm(a, b, one, one, d, mx=False, fast_accum=True)[0] == "ok"
    assert gpu.gemm(a, b, one, one, d, mx=False, fast_accum=False)[0] == "ok"
    assert [c.fast_accum for c in gpu.matmuls()] == [1, -1]


def test_each_device_gets_its_handle_created_with_that_device_current(lib, machine):
    gpu = machine((100, 90))
    rng = np.random.default_rng(9)
    a = placed(random_codes(rng, (1, 8, 32), "float8_e4m3fn"))
    b = placed(random_codes(rng, (1, 16, 32), "float8_e4m3fn"))
    one = placed(np.float32([1.0]))
    d = placed(np.zeros((1, 8, 16), np.float32))
    for device in (1, 0, 1, 0):
        assert gpu.gemm(a, b, one, one, d, mx=False, device=device) == ("ok", "")
        assert lib.double_current_device() == 0  # the thread's device is restored
    assert gpu.handle_devices() == [1, 0]  # one handle per device, on that device
    assert [c.device for c in gpu.matmuls()] == [1, 0, 1, 0]
    lib.double_set_current_device(1)
    code, message = gpu.gemm(a, b, one, one, d, mx=True, device=1)  # device 1 is sm_90
    assert code == "failed_precondition" and "device 1 has compute capability 9.0" in message
    assert lib.double_current_device() == 1


def test_prepare_does_the_setup_so_that_a_run_only_enqueues(lib, machine):
    """XLA's initialize stage (outside graph capture) creates the handle and the plan; the
    execute stage, which may be captured into a CUDA graph, then finds them."""
    gpu = machine()
    (a, b, sa, sb), exact, abs_sum = mx_case(10, 2, 8, 16, 64, ("float8_e4m3fn", "float8_e4m3fn"))
    d = placed(np.zeros((2, 8, 16), np.float32))
    assert gpu.gemm(a, b, sa, sb, d, mx=True, prepare_only=True) == ("ok", "")
    assert (gpu.handle_devices(), lib.double_heuristic_count(), gpu.matmuls()) == ([0], 1, [])
    assert gpu.gemm(a, b, sa, sb, d, mx=True) == ("ok", "")
    assert (gpu.handle_devices(), lib.double_heuristic_count(), len(gpu.matmuls())) == ([0], 1, 1)
    assert_close(d, exact, abs_sum, 64, "float32")


def test_an_unknown_device_is_an_internal_error(machine):
    gpu = machine((100,))
    (a, b, sa, sb), _, _ = mx_case(11, 1, 8, 16, 32, ("float8_e4m3fn", "float8_e4m3fn"))
    d = placed(np.zeros((1, 8, 16), np.float32))
    code, message = gpu.gemm(a, b, sa, sb, d, mx=True, device=3)
    assert code == "internal" and message.startswith("cudaDeviceGetAttribute(device 3) failed")


# --- block FP8 (VEC128_32F / BLK128x128_32F) ---------------------------------------------------

VEC128, BLK128 = 4, 5  # cublasLtMatmulMatrixScale_t values (cublasLt.h)


def block_scales(rng, batch, rows, k, tiled, exponents=(-6, 7)):
    """Compact float32 scales [B, rows or ceil(rows/128), K/128] (mantissas and exponents vary)
    and the cuBLASLt buffer: 1x128 [B, K/128, rows]; tiles [B, ceil(rows/128),
    roundup(K/128, 4)]."""
    outer = -(-rows // 128) if tiled else rows
    compact = rng.uniform(0.5, 2.0, (batch, outer, k // 128)) * 2.0 ** rng.integers(
        *exponents, (batch, outer, 1)
    )
    compact = compact.astype(np.float32)
    if tiled:
        pad = -compact.shape[-1] % 4
        layout = np.pad(compact, ((0, 0), (0, 0), (0, pad)))
    else:
        layout = compact.swapaxes(-1, -2)
    return compact, placed(np.ascontiguousarray(layout))


def block_values(codes, compact, tiled):
    """float64 codes times their expanded float32 scales."""
    rows = codes.shape[1]
    scale = np.repeat(compact, 128, axis=1)[:, :rows] if tiled else compact
    return codes.astype(np.float64) * np.repeat(scale.astype(np.float64), 128, axis=-1)


BLOCK_CASES = [  # batch, m, n, k, tiles, lhs type, rhs type, out type
    (1, 64, 256, 512, "rhs", "float8_e4m3fn", "float8_e4m3fn", "bfloat16"),
    (1, 4, 200, 256, "rhs", "float8_e4m3fn", "float8_e5m2", "float32"),
    (2, 256, 32, 384, "lhs", "float8_e5m2", "float8_e4m3fn", "float32"),
    (3, 16, 48, 128, "", "float8_e4m3fn", "float8_e4m3fn", "float16"),
]


@pytest.mark.parametrize("batch,m,n,k,tiles,lhs,rhs,out", BLOCK_CASES)
def test_block_fp8_gemm_matches_numpy(machine, batch, m, n, k, tiles, lhs, rhs, out):
    rng = np.random.default_rng(m + n + k)
    a = placed(random_codes(rng, (batch, m, k), lhs))
    b = placed(random_codes(rng, (batch, n, k), rhs))
    exponents = (-14, -6) if out == "float16" else (-6, 7)  # float16: results stay finite
    sa_compact, sa = block_scales(rng, batch, m, k, tiles in ("lhs", "both"), exponents)
    sb_compact, sb = block_scales(rng, batch, n, k, tiles in ("rhs", "both"), exponents)
    d = placed(np.zeros((batch, m, n), OUT[out]))
    gpu = machine((90,), 120900)
    assert gpu.gemm(a, b, sa, sb, d, mx=False, tiles=tiles) == ("ok", "")
    x = block_values(a, sa_compact, tiles in ("lhs", "both"))
    y = block_values(b, sb_compact, tiles in ("rhs", "both"))
    exact = np.einsum("bmk,bnk->bmn", x, y)
    assert_close(d, exact, np.einsum("bmk,bnk->bmn", abs(x), abs(y)), k, out)
    records = gpu.matmuls()
    assert len(records) == batch and all(r.batch_count == 1 for r in records)  # one per element
    modes = {"": (VEC128, VEC128), "rhs": (BLK128, VEC128), "lhs": (VEC128, BLK128)}[tiles]
    assert all((r.a_scale_mode, r.b_scale_mode) == modes for r in records)  # A = rhs


def test_block_fp8_needs_hopper_and_cublaslt_12_9(lib, machine):
    e4 = "float8_e4m3fn"
    a, b = placed(np.zeros((1, 16, 256), FP8[e4])), placed(np.zeros((1, 16, 256), FP8[e4]))
    s = placed(np.ones((64,), np.float32))
    d = placed(np.zeros((1, 16, 16), np.float32))
    for cc in (89, 100, 120):
        code, message = machine((cc,), 130100).gemm(a, b, s, s, d, mx=False, tiles="rhs")
        assert code == "failed_precondition" and "runs on compute capability 9.x" in message
    code, message = machine((90,), 120804).gemm(a, b, s, s, d, mx=False, tiles="rhs")
    assert code == "failed_precondition" and "cuBLASLt 12.8.4 is loaded" in message
    # the double refuses the same, and takes the three documented combinations on sm_90
    for cc, version, scaling, status in [
        (90, 120900, 2, "CUBLAS_STATUS_SUCCESS"),
        (90, 120900, 3, "CUBLAS_STATUS_SUCCESS"),
        (90, 120900, 4, "CUBLAS_STATUS_SUCCESS"),
        (90, 120900, 5, "CUBLAS_STATUS_NOT_SUPPORTED"),
        (100, 130100, 3, "CUBLAS_STATUS_NOT_SUPPORTED"),
        (90, 120804, 3, "CUBLAS_STATUS_NOT_SUPPORTED"),
    ]:
        machine((cc,), version)
        assert plain_matmul(lib, 32, 32, 256, (e4, e4), scaling=scaling) == status, (cc, scaling)
    machine((90,), 120900)
    assert plain_matmul(lib, 32, 32, 256, (e4, e4), (0, 0), scaling=3) != "CUBLAS_STATUS_SUCCESS"
    assert lib.double_refusal() == b"only TN on this architecture"


def test_block_fp8_shape_rules(lib, machine):
    e4 = "float8_e4m3fn"
    gpu = machine((90,), 120900)
    s = placed(np.ones((4096,), np.float32))

    def run(m, n, k, tiles):
        a, b = placed(np.zeros((1, m, k), FP8[e4])), placed(np.zeros((1, n, k), FP8[e4]))
        return gpu.gemm(a, b, s, s, placed(np.zeros((1, m, n), np.float32)), mx=False, tiles=tiles)

    code, message = run(16, 16, 192, "rhs")
    assert code == "invalid_argument" and "K must be a multiple of 128" in message
    code, message = run(16, 128, 256, "both")
    assert code == "unimplemented" and "no 128x128 x 128x128" in message
    code, message = run(6, 16, 256, "rhs")  # the 1x128 lhs scale matrix [K/128, 6]
    assert code == "invalid_argument" and "lhs rows M must be a multiple of 4" in message
    assert run(6, 16, 256, "lhs") == ("ok", "")  # tiles: any row count
    # the double: K % 128; the 1x128 scales of op(B) [k, 30] have 30 rows (not 16-byte columns)
    assert plain_matmul(lib, 32, 32, 192, (e4, e4), scaling=2) == "CUBLAS_STATUS_NOT_SUPPORTED"
    assert plain_matmul(lib, 32, 30, 256, (e4, e4), scaling=2) == "CUBLAS_STATUS_NOT_SUPPORTED"
    assert plain_matmul(lib, 32, 30, 256, (e4, e4), scaling=4) == "CUBLAS_STATUS_SUCCESS"


def test_headers_without_the_block_fp8_modes_build_a_core_that_refuses_block_fp8(
    tmp_path_factory,
):
    """cuBLASLt headers older than 12.9: the core must compile without the two enum names (any
    use of them is made an undeclared identifier here) and refuse block FP8 at run time."""
    shim = tmp_path_factory.mktemp("cublaslt_12_8_headers")
    (shim / "cublasLt.h").write_text(
        "#include_next <cublasLt.h>\n"
        "#undef CUBLAS_VERSION\n"
        "#define CUBLAS_VERSION 120800\n"
        "#define CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F not_in_cublaslt_12_8_headers\n"
        "#define CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F not_in_cublaslt_12_8_headers\n"
    )
    old = build(str(shim), core_includes=(str(shim),))
    gpu = Machine(old, (90,), 130100)
    try:
        e4 = FP8["float8_e4m3fn"]
        a, b = placed(np.zeros((1, 16, 256), e4)), placed(np.zeros((1, 16, 256), e4))
        s = placed(np.ones((64,), np.float32))
        code, message = gpu.gemm(a, b, s, s, placed(np.zeros((1, 16, 16), np.float32)),
                                 mx=False, tiles="rhs")  # fmt: skip
        assert code == "unimplemented" and "headers older than 12.9" in message
        d = placed(np.zeros((1, 16, 16), np.float32))
        assert gpu.gemm(a, b, s, s, d, mx=False) == ("ok", "")  # per-tensor FP8 still runs
    finally:
        gpu.close()


# --- FP4 (CUDA_R_4F_E2M1 with VEC16_UE4M3 / VEC32_UE8M0) -------------------------------------

VEC16, VEC32, POINTER_MODE_DEVICE = 1, 2, 1  # cublasLt.h enum values
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def pack_fp4(nibbles: np.ndarray) -> np.ndarray:
    """[..., K] E2M1 codes (0..15) -> [..., K/2] bytes, element 2i in the low nibble."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def fp4_scale_values(scale_bytes: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values of scale bytes: unsigned E4M3 (the sign bit ignored, as cuBLASLt's UE4M3)
    or E8M0 (2^(byte - 127), 0xFF NaN)."""
    if fmt == "nvfp4":
        return (scale_bytes & 0x7F).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    out = 2.0 ** (scale_bytes.astype(np.float64) - 127)
    return np.where(scale_bytes == 0xFF, np.nan, out)


def fp4_reference(a_nib, b_nib, sa_bytes, sb_bytes, alpha, fmt, out_dtype):
    """out [B, M, N]: per block the exact (float64) sum of code products times both scales,
    rounded to float32 and accumulated block after block in float32; then float32(alpha * acc)
    rounded to the output type."""
    block = FP4_BLOCK[fmt]
    x = a_nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    y = b_nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sa, sb = fp4_scale_values(sa_bytes, fmt), fp4_scale_values(sb_bytes, fmt)
    batch, m, k = x.shape
    n = y.shape[1]
    acc = np.zeros((batch, m, n), np.float32)
    for c in range(k // block):
        part = slice(c * block, (c + 1) * block)
        exact = np.einsum("bmk,bnk->bmn", x[..., part], y[..., part])
        with np.errstate(invalid="ignore"):
            value = exact * sa[:, :, c, None] * sb[:, None, :, c]
        acc = (acc + value.astype(np.float32)).astype(np.float32)
    return (alpha.astype(np.float32)[:, None, None] * acc).astype(OUT[out_dtype])


def fp4_case(seed, batch, m, n, k, fmt):
    """Packed operands, swizzled scales, alpha_beta and the compact inputs of an FP4 GEMM."""
    rng = np.random.default_rng(seed)
    block = FP4_BLOCK[fmt]
    a_nib = rng.integers(0, 16, (batch, m, k), dtype=np.uint8)
    b_nib = rng.integers(0, 16, (batch, n, k), dtype=np.uint8)
    if fmt == "nvfp4":  # E4M3 scales 2^-9 .. 448, sign bits set at random (ignored: UE4M3)
        sa = rng.integers(1, 0x7F, (batch, m, k // block), dtype=np.uint8)
        sb = rng.integers(1, 0x7F, (batch, n, k // block), dtype=np.uint8)
        sa |= rng.integers(0, 2, sa.shape, dtype=np.uint8) << 7
    else:
        sa = rng.integers(110, 140, (batch, m, k // block), dtype=np.uint8)
        sb = rng.integers(110, 140, (batch, n, k // block), dtype=np.uint8)
    alpha = np.float32(rng.uniform(0.5, 2.0, batch) * 2.0 ** rng.integers(-24, -16, batch))
    alpha_beta = placed(np.stack([alpha, np.zeros_like(alpha)], -1).astype(np.float32))
    operands = (placed(pack_fp4(a_nib)), placed(pack_fp4(b_nib)))
    operands += (placed(swizzled(sa)), placed(swizzled(sb)))
    return operands, alpha_beta, (a_nib, b_nib, sa, sb, alpha)


FP4_CASES = [  # fmt, batch, m, n, k, out
    ("nvfp4", 1, 5, 16, 64, "float32"),
    ("nvfp4", 3, 130, 32, 96, "bfloat16"),
    ("mxfp4", 2, 7, 48, 128, "float32"),
    ("mxfp4", 1, 33, 16, 64, "float16"),
]


@pytest.mark.parametrize("fmt,batch,m,n,k,out", FP4_CASES)
def test_fp4_gemm_matches_numpy_bit_for_bit(machine, fmt, batch, m, n, k, out):
    gpu = machine((100,), 120800)
    (a, b, sa, sb), alpha_beta, compact = fp4_case(m + n + k, batch, m, n, k, fmt)
    d = placed(np.full((batch, m, n), np.nan, OUT[out]))
    assert gpu.gemm(a, b, sa, sb, d, mx=False, fp4=fmt, alpha_beta=alpha_beta) == ("ok", "")
    want = fp4_reference(*compact[:4], compact[4], fmt, out)
    np.testing.assert_array_equal(d.view(np.uint8), want.view(np.uint8))
    records = gpu.matmuls()  # one call per batch element, each with its alpha from the device
    assert [r.batch_count for r in records] == [1] * batch
    assert [r.alpha for r in records] == [float(x) for x in compact[4]]
    mode = VEC16 if fmt == "nvfp4" else VEC32
    for r in records:
        assert (r.a_scale_mode, r.b_scale_mode, r.pointer_mode) == (mode, mode, POINTER_MODE_DEVICE)
        assert (r.transa, r.transb) == (1, 0)
        assert r.alpha_vector_batch_stride == -1  # no dummy (cuBLASLt 12.8.0 here): FP4 types


@pytest.mark.parametrize("fmt,nan_byte", [("nvfp4", 0x7F), ("mxfp4", 0xFF)])
def test_fp4_nan_scale_gives_nan_in_its_row_only(machine, fmt, nan_byte):
    gpu = machine((100,))
    (a, b, _, sb), alpha_beta, compact = fp4_case(1, 1, 4, 16, 64, fmt)
    sa_compact = compact[2].copy()
    sa_compact[0, 2, 1] = nan_byte
    d = placed(np.zeros((1, 4, 16), np.float32))
    sa = placed(swizzled(sa_compact))
    assert gpu.gemm(a, b, sa, sb, d, mx=False, fp4=fmt, alpha_beta=alpha_beta)[0] == "ok"
    assert np.isnan(d[0, 2]).all() and np.isfinite(d[0, [0, 1, 3]]).all()


def test_fp4_needs_blackwell_cublaslt_12_8_k_a_multiple_of_32_and_device_alpha(machine):
    (a, b, sa, sb), alpha_beta, _ = fp4_case(2, 1, 8, 16, 64, "nvfp4")
    d = placed(np.zeros((1, 8, 16), np.float32))

    def run(gpu, a=a, b=b, **kwargs):
        kwargs = {"fp4": "nvfp4", "alpha_beta": alpha_beta, **kwargs}
        return gpu.gemm(a, b, sa, sb, d, mx=False, **kwargs)

    code, message = run(machine((90,), 130100))
    assert code == "failed_precondition"
    assert "device 0 has compute capability 9.0; FP4 block-scaled matmul" in message
    code, message = run(machine((100,), 120700))
    assert (code, message) == (
        "failed_precondition",
        "cuBLASLt 12.7.0 is loaded; FP4 block scaling needs CUDA/cuBLASLt >= 12.8",
    )
    gpu = machine((100,))
    a48 = placed(np.zeros((1, 8, 24), np.uint8))  # K = 48: rows of 24 bytes
    b48 = placed(np.zeros((1, 16, 24), np.uint8))
    code, message = run(gpu, a48, b48)
    assert code == "invalid_argument" and "K must be a multiple of 32 for FP4" in message
    code, message = run(gpu, alpha_beta=None)
    assert code == "invalid_argument" and "alpha_beta is null" in message
    code, message = run(gpu, types=("float4_e2m1fn", "float8_e4m3fn"))
    assert code == "unimplemented" and "float4_e2m1fn x float8_e4m3fn" in message
    code, message = run(gpu, types=("float8_e4m3fn", "float8_e4m3fn"))
    assert code == "unimplemented" and "takes float4_e2m1fn operands" in message
    code, message = run(gpu, a=placed(a, 8))  # operands 16-byte aligned, or no algorithm
    assert code == "unimplemented" and "no algorithm for NVFP4 block-scaled" in message
    assert gpu.refusal() == "operands aligned to less than 16 bytes"
    assert gpu.matmuls() == []
    assert run(gpu) == ("ok", "")


def test_the_double_refuses_what_cublaslt_refuses_for_fp4(lib, machine):
    f4, e4 = "float4_e2m1fn", "float8_e4m3fn"
    machine((90,))
    assert plain_matmul(lib, 32, 32, 64, (f4, f4), scaling=6) == "CUBLAS_STATUS_NOT_SUPPORTED"
    assert lib.double_refusal() == b"FP4 needs sm_100+ and cuBLASLt 12.8"
    machine((100,), 120700)
    assert plain_matmul(lib, 32, 32, 64, (f4, f4), scaling=1) == "CUBLAS_STATUS_NOT_SUPPORTED"
    machine((100,))
    for scaling in (1, 6):  # MXFP4, NVFP4
        assert plain_matmul(lib, 32, 32, 64, (f4, f4), scaling=scaling) == "CUBLAS_STATUS_SUCCESS"
        for trans in [(0, 0), (1, 1), (0, 1)]:  # sm_100 has other FP8 layouts, not for FP4
            status = plain_matmul(lib, 32, 32, 64, (f4, f4), trans, scaling=scaling)
            assert status == "CUBLAS_STATUS_NOT_SUPPORTED"
            assert lib.double_refusal() == b"FP4 only TN"
    for types, scaling, refusal in [
        ((f4, e4), 1, b"FP4 with FP8"),
        ((e4, f4), 6, b"FP4 with FP8"),
        ((f4, f4), 0, b"FP4 without block scaling"),
        ((e4, e4), 6, b"VEC16_UE4M3 on FP8"),
        ((f4, f4), 6, b"leading dimensions not multiples of 16 bytes"),  # K = 48: 24-byte rows
    ]:
        k = 48 if refusal.startswith(b"leading") else 64
        assert plain_matmul(lib, 32, 32, k, types, scaling=scaling) != "CUBLAS_STATUS_SUCCESS"
        assert lib.double_refusal() == refusal, (types, scaling)
