"""The quantizer implementations (XLA, Pallas) and their choice per lowering platform.

Example:
    >>> from jaxmx._src.quantize.impl import check_impl, check_pallas_tile
    >>> check_impl("pallas")
    'pallas'
    >>> check_pallas_tile((16, 16))
    (16, 16)
"""

from __future__ import annotations

import functools

import jax
from jax import lax

PALLAS_TILE = 128
"""The Pallas kernels' tile side: each grid step reads a 128 x 128 tile of the input."""

IMPLS = ("auto", "xla", "pallas")
"""Quantizer implementations: ``"xla"`` (fused ``jax.numpy``, every backend), ``"pallas"``
(:mod:`jaxmx._src.quantize.pallas`'s kernels: compiled for CUDA GPUs, interpreted on the CPU),
``"auto"`` (XLA on every platform: the kernels have not yet been measured, or run, on a GPU,
so nothing selects them until a GPU shows them faster; see docs/benchmarks.md). ``"pallas"``
is chosen per lowering platform."""


def check_impl(impl) -> str:
    """``impl`` after checking it names an implementation that runs here.

    A ValueError for an unknown ``impl``, and for ``impl="pallas"`` where JAX's default backend
    is neither a GPU nor the CPU (the kernels are written for Triton; interpreting them
    elsewhere is not supported).
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    platform = jax.default_backend()
    if impl == "pallas" and platform not in ("gpu", "cpu"):
        raise ValueError(
            f"impl='pallas' runs on CUDA GPUs (compiled) and on the CPU (interpreted), not on "
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
    """``xla(x)`` or ``pallas(x, interpret=...)`` on each lowering platform, as a checked
    ``impl`` (:func:`check_impl`) says. An empty ``x`` has no tile for a kernel to read: it
    takes ``xla(x)``, whose empty codes and scales are the ones the kernels would write."""
    if impl in ("xla", "auto") or x.size == 0:
        return xla(x)
    compiled = functools.partial(pallas, interpret=False)
    interpreted = functools.partial(pallas, interpret=True)
    return lax.platform_dependent(x, cuda=compiled, default=interpreted)
