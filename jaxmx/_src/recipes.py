"""Recipe, the frozen description of how jaxmx.dot_general quantizes its GEMMs, and presets.

Example:
    >>> from jaxmx._src.recipes import MXFP8
    >>> MXFP8.replace(backend="emulate").backend, hash(MXFP8) == hash(MXFP8.replace())
    ('emulate', True)
"""

from __future__ import annotations

import dataclasses

from jaxmx._src.accumulation import Accumulation
from jaxmx._src.backends import check_backend
from jaxmx._src.formats import check_scale_mode, get_format

RESIDUALS = ("quantized", "high_precision")
GRAD_ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How :func:`jaxmx.dot_general` quantizes its three GEMMs (frozen and hashable).

    Attributes:
        fwd: format of the activations and weights (both copies), e.g. ``"mxfp8_e4m3"``.
        grad: format of the output gradient in the dgrad and wgrad GEMMs.
        scale_mode: E8M0 scale rule, see :data:`jaxmx.SCALE_MODES` (``"rceil"`` by default).
        backend: ``"auto"`` (native cuBLASLt where supported, else emulation), ``"emulate"``
            (exact dequantize + float32-accumulated dot, everywhere) or ``"ffi"`` (the native custom
            call: cuBLASLt on a Blackwell GPU, its C++ twin on the CPU).
        residuals: ``"quantized"`` saves only the columnwise MX copies of both operands for the
            backward pass (about 1 byte per element); ``"high_precision"`` saves the inputs and
            quantizes them in the backward pass.
        grad_rounding: ``"nearest"`` (round to nearest even) or ``"stochastic"`` (unbiased
            stochastic rounding of the output gradient; :func:`jaxmx.dot_general` then needs a
            ``key``).
        accum_bits: ``None`` (exact products, float32 accumulation) or the bits a modelled
            limited-precision accumulator keeps per 32-product step (14 models Hopper's FP8
            tensor cores, see :mod:`jaxmx._src.accumulation`). Emulation only: ``"auto"`` then
            emulates on every platform and ``"ffi"`` is refused.
        promote_every: with ``accum_bits``, promote the partial sum to float32 every this many
            elements of K (a multiple of 32; DeepSeek-V3 uses 128); ``None``: never.
    """

    fwd: str = "mxfp8_e4m3"
    grad: str = "mxfp8_e4m3"
    scale_mode: str = "rceil"
    backend: str = "auto"
    residuals: str = "quantized"
    grad_rounding: str = "nearest"
    accum_bits: int | None = None
    promote_every: int | None = None

    def __post_init__(self):
        get_format(self.fwd)
        get_format(self.grad)
        check_scale_mode(self.scale_mode)
        check_backend(self.backend)
        _check_choice("residuals", self.residuals, RESIDUALS)
        _check_choice("grad_rounding", self.grad_rounding, GRAD_ROUNDINGS)
        if self.accum_bits is None and self.promote_every is not None:
            raise ValueError("Recipe.promote_every needs accum_bits (a limited accumulator)")
        if self.accum_bits is not None:
            Accumulation(self.accum_bits, self.promote_every).check()
            if self.backend == "ffi":
                raise ValueError(
                    "Recipe.accum_bits models the accumulator in the emulation only; use "
                    "backend='auto' or 'emulate', not 'ffi'"
                )

    @property
    def accumulation(self) -> Accumulation | None:
        """The modelled accumulator, or ``None`` for exact float32 accumulation."""
        if self.accum_bits is None:
            return None
        return Accumulation(self.accum_bits, self.promote_every)

    def replace(self, **changes) -> Recipe:
        """A copy with some fields changed, e.g. ``recipe.replace(backend="emulate")``."""
        return dataclasses.replace(self, **changes)


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown Recipe.{field} {value!r}; expected one of {choices}")


MXFP8 = Recipe()
"""NVIDIA's MXFP8 recipe: E4M3 everywhere, rceil scales (matches BF16 training)."""

MXFP8_HYBRID = Recipe(grad="mxfp8_e5m2")
"""E4M3 activations and weights, E5M2 gradients."""
