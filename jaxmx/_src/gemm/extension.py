"""The ``jaxmx._ffi`` extension: loading it, registering its custom-call handlers, and why not.

The extension holds the native GEMM's XLA FFI handlers: plain C++ for the CPU (always built) and
cuBLASLt for CUDA (built with ``JAXMX_CUDA=ON``, see docs/native.md); :func:`build_info` says
which.

Example:
    >>> from jaxmx._src.gemm import extension
    >>> extension.handler_status("cpu")
    'available'
    >>> extension.handler_status("tpu")
    'the extension has handlers for CPU and CUDA only, not tpu'
"""

from __future__ import annotations

import functools
import threading

import jax


@functools.cache
def load():
    """``(module, None)``, or ``(None, reason)`` when the extension does not import."""
    try:
        from jaxmx import _ffi
    except ImportError as e:  # a build without the extension, or a broken one
        return None, f"the extension jaxmx._ffi does not import: {e}"
    return _ffi, None


NO_CUBLASLT = (
    "extension built without the cuBLASLt handler: JAXMX_CUDA was not ON when it was built "
    "(the default; the C++ CPU handler only). To build it: pip install nvidia-cublas "
    "nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl, then JAXMX_CUDA=ON pip install -e . "
    "in the jaxmx clone (docs/native.md)"
)
"""Why there is no CUDA handler in a build without it: the build decided so (``JAXMX_CUDA`` is an
explicit option, default OFF; with it ON, a build without the CUDA headers fails)."""


def build_info() -> dict:
    """What the extension was built with: ``handlers`` (the platforms it has handlers for,
    ``("cpu",)`` or ``("cpu", "cuda")``), ``cuda`` (``"built"`` or why not) and the build's
    own facts (``jaxmx._ffi.build_info()``: compiler, CUDA header versions and directories);
    ``{"handlers": (), "error": why}`` when the extension does not import.

    Example:
        >>> from jaxmx._src.gemm import extension
        >>> extension.build_info()["handlers"][0]
        'cpu'
    """
    ext, reason = load()
    if ext is None:
        return {"handlers": (), "error": reason}
    handlers = ("cpu", "cuda") if ext.has_cuda else ("cpu",)
    return {
        "handlers": handlers,
        "cuda": "built" if ext.has_cuda else NO_CUBLASLT,
        **ext.build_info(),
    }


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
    ext, reason = load()
    if ext is None:
        raise RuntimeError(reason)
    with _lock:
        if _registered:
            return
        for platform, targets in ext.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered = True


@functools.cache
def cpu_status() -> str:
    """``"available"`` when the C++ CPU handler is registered, else why not."""
    ext, reason = load()
    if ext is None:
        return reason
    try:
        register_targets()
    except Exception as e:  # registration is the last thing that could fail
        return f"registering the custom calls failed: {e}"
    return "available"


def handler_status(platform: str) -> str:
    """``"available"`` when the extension registered a handler for a JAX lowering platform
    (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), else why not.

    This decides which branches the custom calls get: a platform without a handler lowers to a
    readable error instead of XLA's "no FFI handler". (Whether the cuBLASLt handler can run on
    the device, e.g. its compute capability, is the handler's own check at run time.)
    """
    ext, reason = load()
    if ext is None:
        return reason
    if platform == "cpu":
        return cpu_status()
    if platform == "cuda":
        if not ext.has_cuda:
            return NO_CUBLASLT
        return cpu_status()  # the same registration covers both platforms
    return f"the extension has handlers for CPU and CUDA only, not {platform}"
