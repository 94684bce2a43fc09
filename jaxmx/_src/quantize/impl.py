"""The quantizer implementations (XLA, Pallas), their check and their dispatch.

Example:
    >>> from jaxmx._src.quantize.impl import check_impl, check_pallas_tile
    >>> check_impl("pallas")
    'pallas'
    >>> check_pallas_tile((16, 16))
    (16, 16)
"""

from __future__ import annotations

import jax

PALLAS_TILE = 128
"""The Pallas kernels' tile side: each grid step reads a 128 x 128 tile of the input."""

IMPLS = ("auto", "xla", "pallas")
"""Quantizer implementations: ``"xla"`` (fused ``jax.numpy``, every backend), ``"pallas"``
(:mod:`jaxmx._src.quantize.pallas`'s kernels, interpreted on the CPU; refused where JAX's
default backend is a GPU, see :data:`PALLAS_ON_GPU`), ``"auto"`` (XLA on every platform)."""

PALLAS_ON_GPU = (
    "impl='pallas' is refused on GPUs: compiled by Pallas' Triton lowering on an H200 "
    "(jax 0.11.2), the kernels wrote +0 where the XLA quantizer writes the E4M3 code of -0 "
    "(MXFP8, blocks along a non-minor axis) and the E2M1 formats (NVFP4, MXFP4) failed to "
    "compile (Triton cannot reshape float4 tensors); use impl='xla' (or 'auto'), the same "
    "bytes on every platform"
)
"""Why compiled kernels are refused: their first GPU run (docs/quantization.md) gave other
bytes than the XLA quantizer, which they exist to reproduce."""


def check_impl(impl) -> str:
    """``impl`` after checking it names an implementation that runs here.

    A ValueError for an unknown ``impl``; for ``impl="pallas"``, a NotImplementedError where
    JAX's default backend is a GPU (:data:`PALLAS_ON_GPU`) and a ValueError where it is
    neither a GPU nor the CPU (the kernels are written for Triton; interpreting them elsewhere
    is not supported).
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    platform = jax.default_backend()
    if impl == "pallas" and platform == "gpu":
        raise NotImplementedError(PALLAS_ON_GPU)
    if impl == "pallas" and platform != "cpu":
        raise ValueError(
            f"impl='pallas' runs on the CPU (interpreted; refused on GPUs), not on "
            f"{platform!r}; use impl='xla' (or 'auto')"
        )
    return impl


def check_pallas_tile(tile: tuple[int, int]) -> tuple[int, int]:
    """``tile``, or a ValueError for a tile the Pallas kernels do not cover: a side that does not
    divide their :data:`PALLAS_TILE`."""
    if any(PALLAS_TILE % n for n in tile):
        raise ValueError(
            f"impl='pallas' covers tiles whose sides divide {PALLAS_TILE}, not {tile}; use "
            "impl='xla'"
        )
    return tile


def dispatch(impl: str, xla, pallas, x):
    """``xla(x)`` or the interpreted kernels ``pallas(x)``, as a checked ``impl``
    (:func:`check_impl`) says, on every lowering platform: a program lowered for CUDA from a
    CPU process (``jax.export``) carries the interpreted kernels too (no compiled ones:
    :data:`PALLAS_ON_GPU`). An empty ``x`` has no tile for a kernel to read: it
    takes ``xla(x)``, whose empty codes and scales are the ones the kernels would write."""
    if impl in ("xla", "auto") or x.size == 0:
        return xla(x)
    return pallas(x)
