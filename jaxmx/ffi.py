"""The native GEMM: thin wrappers around the XLA FFI custom calls of the ``jaxmx._ffi`` extension.

Two custom-call targets, each with a CPU handler (plain C++, always built) and a cuBLASLt handler
(built when the CUDA headers were found, see docs/native.md):

- ``jaxmx_mx_matmul``: MXFP8 operands (E4M3 / E5M2 codes, one E8M0 scale per 32 elements along
  K, scales in the cuBLAS 128x4 tiled layout); cuBLASLt ``VEC32_UE8M0`` block scaling, which
  needs compute capability >= 10.0 and CUDA >= 12.8.
- ``jaxmx_fp8_matmul``: FP8 operands with one float32 scale per tensor (cuBLASLt
  ``SCALAR_32F``, compute capability >= 8.9, so Hopper too).

Both take TN operands, ``a`` [..., M, K] and ``b`` [..., N, K], and return
``a @ b^T`` [..., M, N] in bfloat16, float16 or float32, accumulated in float32.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> from jaxmx import ffi
    >>> a = jaxmx.quantize(jnp.ones((4, 64)))
    >>> b = jaxmx.quantize(jnp.full((8, 64), 0.5))
    >>> ffi.mx_matmul(a, b, jnp.float32)[0, :3].tolist()
    [32.0, 32.0, 32.0]
    >>> ffi.backends()["ffi-cpu"]
    'available'
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxmx import partitioning
from jaxmx.formats import BLOCK_SIZE, FORMATS
from jaxmx.mxarray import MXArray
from jaxmx.swizzle import swizzle_scales

__all__ = [
    "FP8_TARGET",
    "MX_TARGET",
    "NATIVE_FORMATS",
    "WORKSPACE_BYTES",
    "backends",
    "cublaslt_supported",
    "fp8_matmul",
    "mx_matmul",
    "register_targets",
]

MX_TARGET = "jaxmx_mx_matmul"
FP8_TARGET = "jaxmx_fp8_matmul"

WORKSPACE_BYTES = 32 * 1024 * 1024
"""cuBLASLt workspace, allocated by XLA as a second output of the custom call (GPU only)."""

_OUT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32))
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
NATIVE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2")
_N_MULTIPLE = 16  # cuBLASLt: rows of out^T padded so every row of out starts 16-byte aligned
_MX_COMPUTE_CAPABILITY = (10, 0)


# --- the extension and its registration -------------------------------------------------------


@functools.cache
def _extension():
    """``(module, None)`` or ``(None, reason)``."""
    try:
        from jaxmx import _ffi
    except ImportError as e:  # a build without the extension, or a broken one
        return None, f"the extension jaxmx._ffi does not import: {e}"
    return _ffi, None


_lock = threading.Lock()
_registered = False


def register_targets() -> None:
    """Registers the custom-call targets with JAX (idempotent; done on first use).

    The CPU handlers are registered for platform "cpu"; the cuBLASLt handlers, when the extension
    was built with them, for "CUDA" (harmless where JAX has no CUDA backend).
    """
    global _registered
    if _registered:
        return
    ext, reason = _extension()
    if ext is None:
        raise RuntimeError(reason)
    with _lock:
        if _registered:
            return
        for platform, targets in ext.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered = True


# --- availability -----------------------------------------------------------------------------


def backends() -> dict[str, str]:
    """Each GEMM backend mapped to ``"available"`` or the reason it is not on this machine.

    Keys: ``"emulate"`` (pure JAX, always there), ``"ffi-cpu"`` (the C++ CPU handler) and
    ``"cublaslt"`` (the native MX GEMM on the default CUDA device).

    Example:
        >>> from jaxmx import ffi
        >>> sorted(ffi.backends())
        ['cublaslt', 'emulate', 'ffi-cpu']
    """
    return {"emulate": "available", "ffi-cpu": _ffi_cpu_status(), "cublaslt": _cublaslt_status()}


def cublaslt_supported() -> bool:
    """Whether ``mx_matmul`` runs natively on cuBLASLt here (for ``backend="auto"``)."""
    return _cublaslt_status() == "available"


@functools.cache
def _ffi_cpu_status() -> str:
    ext, reason = _extension()
    if ext is None:
        return reason
    try:
        register_targets()
    except Exception as e:  # registration is the last thing that could fail
        return f"registering the custom calls failed: {e}"
    return "available"


@functools.cache
def _cublaslt_status() -> str:
    ext, reason = _extension()
    if ext is None:
        return reason
    if not ext.has_cuda:
        return (
            "extension built without cuBLASLt (no CUDA headers found at build time; "
            "see docs/native.md)"
        )
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return "no CUDA GPU"
    if not devices:
        return "no CUDA GPU"
    libs = ext.cuda_libraries()
    if not libs["loaded"]:
        return libs["error"]
    if libs["cublaslt_version"] < 120800:
        v = libs["cublaslt_version"]
        return f"cuBLASLt {v // 10000}.{v % 10000 // 100} is loaded; MX block scaling needs >= 12.8"
    cc = _compute_capability(devices[0])
    if cc is None:
        return "could not read the CUDA device's compute capability"
    if cc < _MX_COMPUTE_CAPABILITY:
        return (
            f"device has compute capability {cc[0]}.{cc[1]}; MX block scaling needs >= "
            f"{_MX_COMPUTE_CAPABILITY[0]}.{_MX_COMPUTE_CAPABILITY[1]}"
        )
    return "available"


def _compute_capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None


def _handler_status(platform: str) -> str:
    """``"available"`` when the extension registered a handler for a JAX lowering platform
    (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), else why not.

    This decides which branches the custom calls get: a platform without a handler lowers to a
    readable error instead of XLA's "no FFI handler". (Whether the cuBLASLt handler can run on
    the device, e.g. its compute capability, is the handler's own check at run time.)
    """
    ext, reason = _extension()
    if ext is None:
        return reason
    if platform == "cpu":
        return _ffi_cpu_status()
    if platform == "cuda":
        return "available" if ext.has_cuda else _cublaslt_status()
    return f"the extension has handlers for CPU and CUDA only, not {platform}"


# --- MX GEMM -----------------------------------------------------------------------------------


def mx_matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16) -> jax.Array:
    """``a @ b^T`` for MXFP8 operands in TN form, on the native custom call.

    Args:
        a: [..., M, K] quantized along its last axis (``mxfp8_e4m3`` or ``mxfp8_e5m2``).
        b: [..., N, K] quantized along its last axis, same leading (batch) dims and K.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., M, N] in ``out_dtype``, accumulated in float32. The compact scales are swizzled to
        the cuBLAS 128x4 layout right before the call. Works under ``jit`` and ``vmap``.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> from jaxmx import ffi
        >>> a = jaxmx.quantize(jnp.ones((2, 3, 32)))
        >>> b = jaxmx.quantize(jnp.ones((2, 5, 32)), "mxfp8_e5m2")
        >>> ffi.mx_matmul(a, b).shape
        (2, 3, 5)
    """
    _check_mx_operand(a, "a")
    _check_mx_operand(b, "b")
    if a.shape[-1] != b.shape[-1] or a.data.shape[-1] != b.data.shape[-1]:
        raise ValueError(
            f"mx_matmul: contracting sizes differ: a has K = {a.shape[-1]} (padded "
            f"{a.data.shape[-1]}), b has K = {b.shape[-1]} (padded {b.data.shape[-1]}); operands "
            "are a [..., M, K] and b [..., N, K]"
        )
    if a.data.shape[:-2] != b.data.shape[:-2]:
        raise ValueError(
            f"mx_matmul: batch dimensions differ: a {a.data.shape[:-2]} vs b "
            f"{b.data.shape[:-2]} (data shapes {a.data.shape} and {b.data.shape})"
        )
    out_dtype = _check_out_dtype(out_dtype, "mx_matmul")
    register_targets()
    return _mx_call(out_dtype)(a.data, b.data, a.scale, b.scale)


def _check_mx_operand(q, name: str) -> None:
    if not isinstance(q, MXArray):
        raise TypeError(f"mx_matmul: {name} must be an MXArray, got {type(q).__name__}")
    if q.fmt not in NATIVE_FORMATS:
        if q.fmt in FORMATS:
            raise NotImplementedError(
                f"mx_matmul: {name} is {q.fmt}, which the native GEMM does not support yet "
                f"(supported: {', '.join(NATIVE_FORMATS)}); use the emulation backend"
            )
        raise ValueError(f"mx_matmul: {name} has unknown format {q.fmt!r}")
    if q.axis != len(q.shape) - 1:
        raise ValueError(
            f"mx_matmul: {name} must be quantized along its last axis (TN form [..., rows, K]), "
            f"got axis {q.axis} of logical shape {q.shape}; quantize the transposed tensor "
            "(jaxmx.quantize_rowwise_colwise gives both copies)"
        )
    data, scale = q.data, q.scale
    want = jnp.dtype(FORMATS[q.fmt].dtype)
    if data.dtype != want:
        raise TypeError(f"mx_matmul: {name} ({q.fmt}) must hold {want} data, got {data.dtype}")
    if data.ndim < 2:
        raise ValueError(f"mx_matmul: {name} must be [..., rows, K], got data shape {data.shape}")
    k = data.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(
            f"mx_matmul: {name}'s K ({k}) must be a multiple of {BLOCK_SIZE} (MXArray pads it)"
        )
    if scale.dtype != jnp.float8_e8m0fnu:
        raise TypeError(f"mx_matmul: {name}'s scales must be float8_e8m0fnu, got {scale.dtype}")
    if scale.shape != (*data.shape[:-1], k // BLOCK_SIZE):
        raise ValueError(
            f"mx_matmul: {name}'s scales must have shape {(*data.shape[:-1], k // BLOCK_SIZE)} "
            f"for data {data.shape}, got {scale.shape}"
        )


def _check_out_dtype(out_dtype, fn: str):
    try:
        dt = jnp.dtype(out_dtype)
    except TypeError:
        dt = None
    if dt not in _OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return dt


@functools.cache
def _mx_call(out_dtype):
    # vmap outside, SPMD partitioning inside: each device swizzles the scales of its own blocks.
    gemm = partitioning.partitioned_gemm(_mx_per_shard, out_dtype, "jaxmx.ffi.mx_matmul")
    return partitioning.vmappable(gemm, fold=(True, False, True, False))


@functools.cache
def _mx_per_shard(out_dtype):
    """The custom call on (one device's) operands: swizzles the compact scales, then calls."""

    def prepare(n_multiple, a_data, b_data, a_scale, b_scale):
        b_data, b_scale, n = _pad_rows(b_data, b_scale, n_multiple)
        return (a_data, b_data, swizzle_scales(a_scale), swizzle_scales(b_scale)), n

    def impl(a_data, b_data, a_scale, b_scale):
        return _custom_call(
            MX_TARGET, "mx_matmul", out_dtype, prepare, a_data, b_data, a_scale, b_scale
        )

    return impl


def _pad_rows(data, scale, multiple: int):
    """Zero rows appended to a [..., N, K] operand (and its [..., N, *] scales) up to a multiple.

    Zero codes contribute nothing whatever their scale, and the extra output columns are dropped.
    """
    n = data.shape[-2]
    pad = -n % multiple
    if pad:
        widths = [(0, 0)] * (data.ndim - 2) + [(0, pad), (0, 0)]
        data = jnp.pad(data, widths)
        if scale.ndim == data.ndim:
            scale = jnp.pad(_bytes(scale), widths)
    return data, scale, n


def _bytes(scale):
    if scale.dtype == jnp.float8_e8m0fnu:
        return lax.bitcast_convert_type(scale, jnp.uint8)
    return scale


# --- per-tensor FP8 GEMM --------------------------------------------------------------------


def fp8_matmul(a_fp8, b_fp8, a_scale, b_scale, out_dtype=jnp.bfloat16) -> jax.Array:
    """``(a_scale * b_scale) * (a @ b^T)`` for FP8 operands with per-tensor float32 scales.

    The cuBLASLt FP8 GEMM (compute capability >= 8.9, Hopper included) through the same
    machinery as :func:`mx_matmul`; on CPU the C++ handler.

    Args:
        a_fp8: [..., M, K] float8_e4m3fn or float8_e5m2.
        b_fp8: [..., N, K], same leading dims and K; E5M2 x E5M2 is not offered (cuBLASLt has
            no such kernel). K must be a multiple of 16 (a cuBLASLt FP8 requirement).
        a_scale, b_scale: float32 scalars (or one per batch element, shaped like the batch dims)
            that dequantize the operands: ``a = a_scale * a_fp8``.
        out_dtype: bfloat16 (default), float16 or float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx import ffi
        >>> a = jnp.ones((2, 16), jnp.float8_e4m3fn)
        >>> ffi.fp8_matmul(a, a, 0.5, 2.0, jnp.float32).tolist()
        [[16.0, 16.0], [16.0, 16.0]]
    """
    a_fp8, b_fp8 = jnp.asarray(a_fp8), jnp.asarray(b_fp8)
    for name, x in (("a_fp8", a_fp8), ("b_fp8", b_fp8)):
        if x.dtype not in _FP8_DTYPES:
            raise TypeError(
                f"fp8_matmul: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}"
            )
        if x.ndim < 2:
            raise ValueError(f"fp8_matmul: {name} must be [..., rows, K], got shape {x.shape}")
    if a_fp8.dtype == b_fp8.dtype == jnp.float8_e5m2:
        raise TypeError(
            "fp8_matmul: float8_e5m2 x float8_e5m2 is not supported (cuBLASLt has no such FP8 "
            "kernel); make one operand float8_e4m3fn"
        )
    if a_fp8.shape[-1] != b_fp8.shape[-1]:
        raise ValueError(
            f"fp8_matmul: contracting sizes differ: a {a_fp8.shape} vs b {b_fp8.shape} "
            "(operands are [..., M, K] and [..., N, K])"
        )
    if a_fp8.shape[-1] % 16:
        raise ValueError(f"fp8_matmul: K must be a multiple of 16, got {a_fp8.shape[-1]}")
    batch = a_fp8.shape[:-2]
    if b_fp8.shape[:-2] != batch:
        raise ValueError(f"fp8_matmul: batch dimensions differ: a {batch} vs b {b_fp8.shape[:-2]}")
    scales = []
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        s = jnp.asarray(s)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            raise TypeError(f"fp8_matmul: {name} must be a float scale, got {s.dtype}")
        if s.shape not in ((), batch):
            raise ValueError(
                f"fp8_matmul: {name} must be a scalar or have the batch shape {batch}, got "
                f"{s.shape}"
            )
        scales.append(jnp.broadcast_to(s.astype(jnp.float32), batch))
    out_dtype = _check_out_dtype(out_dtype, "fp8_matmul")
    register_targets()
    return _fp8_call(out_dtype)(a_fp8, b_fp8, *scales)


@functools.cache
def _fp8_call(out_dtype):
    def prepare(n_multiple, a_fp8, b_fp8, a_scale, b_scale):
        b_fp8, _, n = _pad_rows(b_fp8, b_scale, n_multiple)
        return (a_fp8, b_fp8, a_scale, b_scale), n

    def impl(a_fp8, b_fp8, a_scale, b_scale):
        return _custom_call(
            FP8_TARGET, "fp8_matmul", out_dtype, prepare, a_fp8, b_fp8, a_scale, b_scale
        )

    return partitioning.vmappable(impl, fold=(True, False, False, False))


# --- the custom call on each platform --------------------------------------------------------

# (platform, workspace bytes, rows of the rhs padded to a multiple of)
_PLATFORMS = (("cpu", 0, 1), ("cuda", WORKSPACE_BYTES, _N_MULTIPLE))


def _custom_call(target: str, fn: str, out_dtype, prepare, *args) -> jax.Array:
    """``target`` on ``(a, b, a_scale, b_scale)``, lowered per platform.

    ``prepare(n_multiple, *args)`` gives the custom call's operands, the rhs rows padded to
    ``n_multiple``, and the number of output columns to keep. Platforms without a handler
    (:func:`_handler_status`) get a branch that fails at lowering with the reason.
    """

    def branch(workspace: int, n_multiple: int):
        def run(*args):
            operands, n = prepare(n_multiple, *args)
            out_shape = (*operands[0].shape[:-1], operands[1].shape[-2])
            out, _ = jax.ffi.ffi_call(
                target,
                (
                    jax.ShapeDtypeStruct(out_shape, out_dtype),
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8),
                ),
            )(*operands)
            # inside shard_map: varying like the operands (ffi_call results are not)
            return partitioning.vary_like(out[..., :n], *args)

        return run

    branches = {
        platform: branch(workspace, n_multiple)
        for platform, workspace, n_multiple in _PLATFORMS
        if _handler_status(platform) == "available"
    }

    def unsupported(*args):
        a, b = args[0], args[1]
        out = _unsupported_p.bind(
            *args,
            shape=(*a.shape[:-1], b.shape[-2]),
            dtype=out_dtype,
            fn=fn,
            handled=tuple(branches),
        )
        return partitioning.vary_like(out, *args)

    return lax.platform_dependent(*args, **branches, default=unsupported)


# The default branch of the custom calls: lowering it (for a platform without a handler) raises.
_unsupported_p = Primitive("jaxmx_ffi_unsupported_platform")
_unsupported_p.def_abstract_eval(
    lambda *args, shape, dtype, fn, handled: jax.core.ShapedArray(shape, dtype)
)
_unsupported_p.def_impl(
    lambda *args, **params: jax.jit(functools.partial(_unsupported_p.bind, **params))(*args)
)


def _unsupported_lowering(ctx, *args, shape, dtype, fn, handled):
    platforms = [p for p in ctx.module_context.platforms if p not in handled]
    reasons = "; ".join(f"{p}: {_handler_status(p)}" for p in platforms)
    raise RuntimeError(
        f"jaxmx.ffi.{fn}: the native GEMM (backend='ffi') has no handler for platform "
        f"{', '.join(repr(p) for p in platforms) or 'this platform'} ({reasons or 'unknown'}); "
        "use backend='emulate' there"
    )


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
