"""What this machine's CUDA device and cuBLASLt can run: one value, probed once, that tests build.

Every native GEMM needs a compute capability and a cuBLASLt version; :data:`REQUIREMENTS` is the
one table of them. :class:`Capabilities` is what a machine has; :func:`current` is this
machine's (probed on first use), or the value of an enclosing :func:`assume` block, which is how
tests (and a user who lowers for another machine) ask "what would run on a Blackwell GPU?".
:func:`native_family` names the native GEMM that takes a pair of formats.

Example:
    >>> from jaxmx._src.gemm.capabilities import Capabilities, assume, current
    >>> hopper = Capabilities(compute_capability=(9, 0), cublaslt_version=120900)
    >>> hopper.status("block_fp8"), hopper.supports("mx")
    ('available', False)
    >>> hopper.status("mx")
    'device has compute capability 9.0; MX block scaling needs >= 10.0'
    >>> with assume(hopper):
    ...     current().supports("block_fp8")
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax

from jaxmx._src.core.formats import get_format
from jaxmx._src.gemm import extension


@dataclasses.dataclass(frozen=True, kw_only=True)
class Requirement:
    """What one native GEMM needs of the device and of cuBLASLt."""

    # the feature, as messages name it
    what: str
    # the smallest compute capability that runs it (None: see `major`)
    min_capability: tuple[int, int] | None = None
    # the one major version that runs it (block FP8 kernels exist on Hopper only), and its name
    major: int | None = None
    major_name: str = ""
    # the smallest cuBLASLt version (major * 10000 + minor * 100 + patch) that has it
    min_cublaslt: int

    def capability_problem(self, cc: tuple[int, int]) -> str:
        """Why a device of compute capability ``cc`` cannot run it, or ``""``."""
        have = f"device has compute capability {cc[0]}.{cc[1]}"
        if self.major is not None and cc[0] != self.major:
            return f"{have}; {self.what} runs on {self.major}.x ({self.major_name})"
        if self.min_capability is not None and cc < self.min_capability:
            need = self.min_capability
            return f"{have}; {self.what} needs >= {need[0]}.{need[1]}"
        return ""


REQUIREMENTS: dict[str, Requirement] = {
    "mx": Requirement(what="MX block scaling", min_capability=(10, 0), min_cublaslt=120800),
    "fp4": Requirement(
        what="FP4 block scaling (NVFP4 / MXFP4)", min_capability=(10, 0), min_cublaslt=120800
    ),
    "block_fp8": Requirement(
        what="block-FP8 scaling (1x128 / 128x128 float32 scales)",
        major=9,
        major_name="Hopper",
        min_cublaslt=120900,
    ),
    "fp8": Requirement(what="per-tensor FP8", min_capability=(8, 9), min_cublaslt=110800),
}
"""The native GEMMs (the keys are :attr:`jaxmx.Format.gemm` families; ``"fp8"`` is
:func:`jaxmx.ffi.fp8_matmul`, the GEMM of the per-tensor and per-row FP8 formats) and what each
needs: MXFP8 and FP4 block scaling (``VEC32_UE8M0``, ``VEC16_UE4M3``) from cuBLASLt 12.8 on
compute capability >= 10.0; block FP8 (``VEC128_32F``, ``BLK128x128_32F``) from cuBLASLt 12.9 on
9.x; per-tensor FP8 (``SCALAR_32F``) on >= 8.9."""


def native_family(formats: tuple[str, ...]) -> str | None:
    """The native GEMM (a key of :data:`REQUIREMENTS`, the formats' ``Format.gemm``) that takes
    operands of these formats, or None: formats of no native GEMM or of two families, two scale
    kinds (MXFP4 with NVFP4: cuBLASLt scales both operands with one mode), or E5M2 x E5M2
    (cuBLASLt's FP8 type table has E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 only).

    Example:
        >>> native_family(("mxfp8_e4m3", "mxfp8_e5m2")), native_family(("mxfp4", "nvfp4"))
        ('mx', None)
    """
    fs = [get_format(f) for f in formats]
    if not fs or len({f.gemm for f in fs}) != 1 or len({f.scale_kind for f in fs}) != 1:
        return None
    if all(f.dtype.name == "float8_e5m2" for f in fs):
        return None
    return fs[0].gemm


def native_pair(formats: tuple[str, ...]) -> bool:
    """Whether a native GEMM (MX, block FP8, FP4 or per-tensor FP8) takes operands of these
    formats."""
    return native_family(formats) is not None


NON_TN_MX_MAJOR = 10
"""The compute capability major whose MXFP8 kernels take non-TN layouts (8.9, 9.x and 12.x are
TN only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """The default CUDA device and cuBLASLt as the native GEMMs see them.

    The default value is a machine without a usable CUDA device.
    """

    # why there is no usable CUDA device (read only where compute_capability is None)
    no_device: str = "no CUDA GPU"
    # (major, minor) of the default CUDA device, None where there is none
    compute_capability: tuple[int, int] | None = None
    # the loaded cuBLASLt's version (major * 10000 + minor * 100 + patch), None if none loaded
    cublaslt_version: int | None = None
    # why cuBLASLt did not load (read only where cublaslt_version is None)
    cublaslt_error: str = "cuBLASLt is not loaded"
    # (platform, why) for lowering platforms taken to have no custom-call handler; every other
    # platform's handler is as the extension says (extension.handler_status)
    missing_handlers: tuple[tuple[str, str], ...] = ()

    def status(self, gemm: str) -> str:
        """``"available"`` where the native GEMM ``gemm`` (a key of :data:`REQUIREMENTS`) runs
        on this device, else why not."""
        need = REQUIREMENTS[gemm]
        cc = self.compute_capability
        if cc is None:
            return self.no_device
        problem = need.capability_problem(cc)
        if problem:
            return problem
        v = self.cublaslt_version
        if v is None:
            return self.cublaslt_error
        if v < need.min_cublaslt:
            want = need.min_cublaslt
            return (
                f"cuBLASLt {v // 10000}.{v % 10000 // 100} is loaded; {need.what} needs >= "
                f"{want // 10000}.{want % 10000 // 100}"
            )
        return "available"

    def supports(self, gemm: str) -> bool:
        """Whether the native GEMM ``gemm`` runs on this device."""
        return self.status(gemm) == "available"

    def handler(self, platform: str) -> str:
        """``"available"`` where the extension has a custom-call handler for the lowering
        ``platform``, else why not."""
        return dict(self.missing_handlers).get(platform) or extension.handler_status(platform)

    @property
    def non_tn_mx(self) -> bool:
        """Whether the native MX GEMM runs here and takes K-first operands untransposed (compute
        capability 10.x; elsewhere a K-first operand is transposed to TN form first)."""
        cc = self.compute_capability
        return self.supports("mx") and cc is not None and cc[0] == NON_TN_MX_MAJOR


_assumed: contextvars.ContextVar[Capabilities | None] = contextvars.ContextVar(
    "jaxmx_capabilities", default=None
)


def current() -> Capabilities:
    """The capabilities GEMMs traced now are lowered for: an enclosing :func:`assume` block's,
    else this machine's (:func:`probe`)."""
    assumed = _assumed.get()
    return probe() if assumed is None else assumed


@contextlib.contextmanager
def assume(capabilities: Capabilities) -> Iterator[Capabilities]:
    """Traces in the block choose kernels as if the machine had ``capabilities``.

    Functions jitted before the block keep the traces they made: trace inside it.
    """
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"assume takes a Capabilities, got {type(capabilities).__name__}")
    token = _assumed.set(capabilities)
    try:
        yield capabilities
    finally:
        _assumed.reset(token)


@functools.cache
def probe() -> Capabilities:
    """This machine's capabilities: the extension's cuBLASLt handler, the default CUDA device,
    the cuBLASLt library it loads (read once per process)."""
    ext, reason = extension.load()
    if ext is None:
        return Capabilities(no_device=reason)
    if not ext.has_cuda:
        return Capabilities(no_device=extension.NO_CUBLASLT)
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if not devices:
        return Capabilities(no_device="no CUDA GPU")
    cc = compute_capability(devices[0])
    if cc is None:
        return Capabilities(no_device="could not read the CUDA device's compute capability")
    libs = ext.cuda_libraries()
    if not libs["loaded"]:
        return Capabilities(compute_capability=cc, cublaslt_error=libs["error"])
    return Capabilities(compute_capability=cc, cublaslt_version=libs["cublaslt_version"])


def compute_capability(device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, or None where the device does not say."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None
