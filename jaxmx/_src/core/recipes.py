"""Recipe, the frozen description of how jaxmx.dot_general quantizes its GEMMs, and presets.

Example:
    >>> from jaxmx._src.core.recipes import MXFP8
    >>> MXFP8.replace(backend="emulate").backend, hash(MXFP8) == hash(MXFP8.replace())
    ('emulate', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxmx._src.core.formats import Format, check_gemm_operand, check_scale_mode, get_format
from jaxmx._src.core.support import lacks

BACKENDS = ("auto", "emulate", "ffi", "xla")
"""The values of ``backend=`` / ``Recipe.backend``."""

EMULATION_ONLY = ("ffi", "xla")
"""The backends that cannot take a modelled accumulator (``accum_bits``)."""


def check_backend(backend: str) -> str:
    """Returns ``backend`` if it is one of :data:`BACKENDS`, else raises a ValueError."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return backend


STEP = 32  # products aligned together
MAX_BITS = 18  # 33 terms of up to 2^18 quanta: the step's sum is exact in float32


class Accumulation(NamedTuple):
    """A limited-precision accumulator: ``bits`` kept per 32-product step, and the period (in
    elements of K, a multiple of 32) at which partial sums are promoted to float32 (``None``:
    never, the whole K is one partial sum)."""

    bits: int
    promote_every: int | None = None

    def check(self) -> Accumulation:
        """Itself, after checking its fields (``ValueError`` naming the bad one; a TypeError for
        a bool, which is no accumulator width)."""
        if isinstance(self.bits, bool) or isinstance(self.promote_every, bool):
            raise TypeError(
                f"accum_bits and promote_every must be integers, not bools, got accum_bits="
                f"{self.bits!r}, promote_every={self.promote_every!r}"
            )
        if not isinstance(self.bits, int) or not 1 <= self.bits <= MAX_BITS:
            raise ValueError(
                f"accum_bits must be an integer in [1, {MAX_BITS}] (the model sums each step's "
                f"33 truncated terms exactly in float32), got {self.bits!r}"
            )
        every = self.promote_every
        if every is not None and (not isinstance(every, int) or every <= 0 or every % STEP):
            raise ValueError(f"promote_every must be a positive multiple of {STEP}, got {every!r}")
        return self


RESIDUALS = ("quantized", "high_precision")
WGRADS = ("quantized", "high_precision")
GRAD_ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """How :func:`jaxmx.dot_general` quantizes its three GEMMs (frozen and hashable).

    Attributes:
        fwd: format of the activations and weights (both copies), e.g. ``"mxfp8_e4m3"`` or
            ``"fp8_e4m3_block"``.
        grad: format of the output gradient in the dgrad and wgrad GEMMs.
        scale_mode: the scale rule of both formats: :data:`jaxmx.SCALE_MODES` for MX formats
            (``"rceil"`` by default), :data:`jaxmx.BLOCK_SCALE_MODES` (``"fp32"``, ``"pow2"``)
            for block FP8, :data:`jaxmx.CURRENT_SCALE_MODES` (``"fp32"``, ``"pow2"``) for the
            per-tensor and per-row FP8 formats.
        backend: ``"auto"`` (native cuBLASLt where supported, else emulation), ``"emulate"``
            (exact dequantize + float32-accumulated dot, everywhere) or ``"ffi"`` (the native
            custom call: cuBLASLt on a CUDA GPU that runs the format's GEMM, MXFP8 and FP4 on
            Blackwell, block FP8 on Hopper, per-tensor and per-row FP8 from compute capability
            8.9; its C++ twin on the CPU) or ``"xla"``
            (``jax.lax.scaled_dot``, XLA's block-scaled dot, on every platform: MX formats,
            NVFP4, block FP8 with ``scale_mode="pow2"``; see docs/training_gemm.md).
        residuals: ``"quantized"`` saves only the columnwise MX copies of both operands for the
            backward pass (about 1 byte per element); ``"high_precision"`` saves the inputs and
            quantizes them in the backward pass.
        grad_rounding: ``"nearest"`` (round to nearest even) or ``"stochastic"`` (unbiased
            stochastic rounding of the output gradient; :func:`jaxmx.dot_general` then needs a
            ``key``).
        accum_bits: ``None`` (exact products, float32 accumulation) or the bits a modelled
            limited-precision accumulator keeps per 32-product step (14 models Hopper's FP8
            tensor cores, see :mod:`jaxmx._src.gemm.accumulation`). Emulation only: ``"auto"`` then
            emulates on every platform and ``"ffi"`` and ``"xla"`` are refused.
        promote_every: with ``accum_bits``, promote the partial sum to float32 every this many
            elements of K (a multiple of 32; DeepSeek-V3 uses 128); ``None``: never.
        weight_tile: ``None``, or ``(block, block)`` of ``fwd``'s block: the weight (the rhs of
            :func:`jaxmx.dot_general`) is quantized once per step in 2-D tiles, and the same
            bytes serve the forward GEMM and, transposed, the input-gradient GEMM.
        rht: apply the random Hadamard transform (:func:`jaxmx.rht`, 16x16 blocks) to both
            operands of the weight-gradient GEMM along its reduction axis before they are
            quantized: the product is unchanged in exact arithmetic, and outliers are spread
            over their 16-blocks.
        rht_seed: the seed of the transform's random signs (one fixed sign vector for every
            layer and step, derived from ``jax.random.key(rht_seed)``).
        wgrad: ``"quantized"`` (default: the weight-gradient GEMM on quantized operands, as the
            other two) or ``"high_precision"``: the weight gradient is the float32-accumulated
            product of the unquantized output gradient and lhs (torchao's
            ``rowwise_with_gw_hp``); the lhs is then saved in high precision for the backward
            pass whatever ``residuals`` says (the rhs as ``residuals`` says).
        exact_emulation: ``True``: the emulated training GEMMs check their operands' E8M0
            block scales and take the exact path where those span more than the row-relative
            frame keeps, as :func:`jaxmx.matmul` always does: exact (up to float32 summation)
            for every pair of scale rows, at about twice the step's compile time.
            ``False`` (default): the frame only, which loses the products of blocks lying
            together more than about ``2^100`` below their rows' largest blocks
            (docs/native.md). It needs a format with E8M0 scales, ``backend`` ``"auto"`` or
            ``"emulate"`` (``"ffi"`` and ``"xla"`` are exact there already) and float32
            accumulation (no ``accum_bits``).

    Every field is keyword-only: ``Recipe(grad="mxfp8_e5m2")``, not ``Recipe("mxfp8_e4m3", ...)``.
    """

    fwd: str = "mxfp8_e4m3"
    grad: str = "mxfp8_e4m3"
    scale_mode: str = "rceil"
    backend: str = "auto"
    residuals: str = "quantized"
    grad_rounding: str = "nearest"
    accum_bits: int | None = None
    promote_every: int | None = None
    weight_tile: tuple[int, int] | None = None
    rht: bool = False
    rht_seed: int = 0
    wgrad: str = "quantized"
    exact_emulation: bool = False

    def __post_init__(self):
        fwd = check_gemm_operand(get_format(self.fwd), "Recipe.fwd")
        grad = check_gemm_operand(get_format(self.grad), "Recipe.grad")
        check_scale_mode(self.scale_mode, fwd)
        check_scale_mode(self.scale_mode, grad)
        _check_choice("wgrad", self.wgrad, WGRADS)
        if self.weight_tile is not None and (missing := lacks(fwd, "tiles")):
            raise ValueError(
                f"Recipe.weight_tile: {fwd.name} has {missing}, no 2-D tiles; use weight_tile=None"
            )
        if self.rht and self.wgrad == "high_precision":
            raise ValueError(
                "Recipe.rht transforms the weight-gradient GEMM's quantized operands; with "
                "wgrad='high_precision' nothing is quantized there and it would do nothing"
            )
        if self.weight_tile is not None:
            if _as_tuple(self.weight_tile) != (fwd.block, fwd.block):
                raise ValueError(
                    f"Recipe.weight_tile must be None or ({fwd.block}, {fwd.block}) for "
                    f"{fwd.name} (square tiles of its block), got {self.weight_tile!r}"
                )
            object.__setattr__(self, "weight_tile", (fwd.block, fwd.block))
        check_backend(self.backend)
        if not isinstance(self.rht, bool):
            raise TypeError(f"Recipe.rht must be True or False, got {self.rht!r}")
        if isinstance(self.rht_seed, bool) or not isinstance(self.rht_seed, int):
            raise TypeError(f"Recipe.rht_seed must be an int, got {self.rht_seed!r}")
        _check_choice("residuals", self.residuals, RESIDUALS)
        _check_choice("grad_rounding", self.grad_rounding, GRAD_ROUNDINGS)
        check_accumulation(
            self.accum_bits, self.promote_every, (fwd, grad), self.backend, where="Recipe"
        )
        problem = self.backend == "xla" and scaled_dot_problem((fwd, grad), self.scale_mode)
        if problem:
            raise ValueError(f"Recipe(backend='xla'): {problem}")
        if not isinstance(self.exact_emulation, bool):
            raise TypeError(
                f"Recipe.exact_emulation must be True or False, got {self.exact_emulation!r}"
            )
        if self.exact_emulation and (problem := _exact_emulation_problem(self, (fwd, grad))):
            raise ValueError(f"Recipe.exact_emulation=True would do nothing: {problem}")

    @property
    def accumulation(self) -> Accumulation | None:
        """The modelled accumulator, or ``None`` for exact float32 accumulation."""
        if self.accum_bits is None:
            return None
        return Accumulation(self.accum_bits, self.promote_every)

    def replace(self, **changes) -> Recipe:
        """A copy with some fields changed, e.g. ``recipe.replace(backend="emulate")``."""
        return dataclasses.replace(self, **changes)


def check_recipe(recipe: Any, where: str, *, name: str = "recipe", optional: bool = False):
    """Returns ``recipe`` if it is a :class:`Recipe` (or ``None`` with ``optional``), else raises
    a TypeError naming ``where`` (the caller) and ``name`` (the argument).

    Example:
        >>> check_recipe(MXFP8, "jaxmx.einsum") is MXFP8
        True
        >>> check_recipe("mxfp8", "jaxmx.einsum")
        Traceback (most recent call last):
        TypeError: jaxmx.einsum: recipe must be a jaxmx.Recipe (e.g. ...), got 'mxfp8'
    """
    if isinstance(recipe, Recipe) or (optional and recipe is None):
        return recipe
    also = " or None (plain high precision)" if optional else ""
    raise TypeError(
        f"{where}: {name} must be a jaxmx.Recipe (e.g. jaxmx.recipes.MXFP8){also}, got {recipe!r}"
    )


def check_accumulation(
    accum_bits: int | None,
    promote_every: int | None,
    formats: Sequence[str | Format],
    backend: str,
    where: str,
) -> Accumulation | None:
    """The modelled accumulator of ``accum_bits`` and ``promote_every`` (``None``: exact float32
    accumulation), after checking that it can serve GEMMs of ``formats`` run by ``backend``; the
    ValueError names ``where`` (``"Recipe"``, ``"jaxmx.matmul"``...).

    The rules: ``promote_every`` needs ``accum_bits``; both within :meth:`Accumulation.check`'s
    ranges; MX formats only; the emulation only (``backend`` ``"auto"`` or ``"emulate"``, not
    :data:`EMULATION_ONLY`'s; an unknown one is :func:`check_backend`'s ValueError).

    Example:
        >>> check_accumulation(14, 128, ("mxfp8_e4m3",), "auto", "Recipe")
        Accumulation(bits=14, promote_every=128)
        >>> check_accumulation(None, None, ("nvfp4",), "ffi", "Recipe") is None
        True
        >>> check_accumulation(14, None, ("mxfp8_e4m3",), "ffi", "jaxmx.matmul")
        Traceback (most recent call last):
        ValueError: jaxmx.matmul: accum_bits models the accumulator in the emulation only; backend 'ffi' cannot take it (use 'auto' or 'emulate')
    """  # noqa: E501
    if accum_bits is None:
        if promote_every is not None:
            raise ValueError(f"{where}: promote_every needs accum_bits (a limited accumulator)")
        return None
    accumulation = Accumulation(accum_bits, promote_every).check()
    formats = [get_format(f) for f in formats]
    if not all(f.is_mx for f in formats):
        names = " x ".join(f.name for f in formats)
        raise ValueError(f"{where}: accum_bits models MX GEMMs only, got {names}")
    if check_backend(backend) in EMULATION_ONLY:
        raise ValueError(
            f"{where}: accum_bits models the accumulator in the emulation only; backend "
            f"{backend!r} cannot take it (use 'auto' or 'emulate')"
        )
    return accumulation


def scaled_dot_problem(formats: Sequence[str | Format], scale_mode: str | None) -> str:
    """Why ``backend="xla"`` (``jax.lax.scaled_dot``) cannot run a GEMM of ``formats`` as exactly
    as the emulation does, or ``""``. ``scale_mode``: the rule the operands are quantized with
    (``None``: they come quantized, their rule unknown).

    It takes pairs of one scale kind and block: MX formats (E8M0 scales, 32-blocks: MXFP8 E4M3 /
    E5M2, MXFP4; not MXFP6 or MXINT8, whose elements XLA has no type for) with each other,
    NVFP4 with NVFP4, and block FP8 whose scales are powers of two (``scale_mode="pow2"``, run
    as its MXFP8 twin). Float32 block scales are refused: ``lax.scaled_dot``'s decomposition
    rounds scales to bfloat16.

    Example:
        >>> scaled_dot_problem(("mxfp8_e4m3", "mxfp4"), None)
        ''
        >>> scaled_dot_problem(("fp8_e4m3_block",) * 2, "fp32")[:40]
        'fp8_e4m3_block x fp8_e4m3_block: float32'
    """
    fs = [get_format(f) for f in formats]
    names = " x ".join(f.name for f in fs)
    for f in fs:
        if missing := lacks(f, "xla"):
            return (
                f"{names}: {f.name} has {missing}; lax.scaled_dot does not take it (use "
                "backend='emulate' or 'auto')"
            )
    if len({f.scale_kind.name for f in fs}) != 1 or len({f.block for f in fs}) != 1:
        return (
            f"{names} mixes scale kinds or block sizes; it takes pairs of one scale kind and "
            "block (MX with MX, NVFP4 with NVFP4, block FP8 with block FP8)"
        )
    if fs[0].pow2_twin is not None and scale_mode != "pow2":
        return (
            f"{names}: float32 block scales (scale_mode={scale_mode!r}) are not exact in "
            "lax.scaled_dot, whose decomposition rounds each scale to bfloat16; it takes block "
            "FP8 only as quantized by a recipe with scale_mode='pow2' (jaxmx.recipes."
            "FP8_BLOCK_POW2), run as its MXFP8 twin"
        )
    return ""


def _exact_emulation_problem(r: Recipe, formats: tuple[Format, Format]) -> str:
    """Why ``exact_emulation=True`` changes nothing for ``r``, or ``""``: only the emulation of
    E8M0-scaled operands, with float32 accumulation, has a row-relative frame to leave."""
    missing = [lacks(f, "exact_emulation") for f in formats]
    if all(missing):
        return f"{formats[0].name} has {missing[0]}, and so has {formats[1].name}"
    if r.backend not in ("auto", "emulate"):
        return f"backend={r.backend!r} is exact for every pair of scale rows already"
    if r.accum_bits is not None:
        return "accum_bits models the accumulator, which the exact path does not"
    return ""


def _as_tuple(value) -> tuple | None:
    """``tuple(value)``, or ``None`` for a value that is not iterable (e.g. a bare int)."""
    try:
        return tuple(value)
    except TypeError:
        return None


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown Recipe.{field} {value!r}; expected one of {choices}")


MXFP8 = Recipe()
"""NVIDIA's MXFP8 recipe: E4M3 everywhere, rceil scales (matches BF16 training)."""

MXFP8_HYBRID = Recipe(grad="mxfp8_e5m2")
"""E4M3 activations and weights, E5M2 gradients."""

MXFP8_2D = Recipe(weight_tile=(32, 32))
"""MXFP8 with 32x32 weight tiles: one quantization of each weight per step serves the forward
and the input-gradient GEMMs (W and W^T quantized consistently)."""

DEEPSEEK_FP8 = Recipe(
    fwd="fp8_e4m3_block", grad="fp8_e4m3_block", scale_mode="fp32", weight_tile=(128, 128)
)
"""DeepSeek-V3's FP8 recipe: E4M3 everywhere, activations and gradients in 1x128 blocks along
each GEMM's reduction axis, weights in 128x128 tiles, float32 scales (``amax / 448``)."""

FP8_BLOCK_POW2 = DEEPSEEK_FP8.replace(scale_mode="pow2")
""":data:`DEEPSEEK_FP8` with power-of-two scales."""

NVFP4 = Recipe(
    fwd="nvfp4",
    grad="nvfp4",
    scale_mode="e4m3",
    weight_tile=(16, 16),
    rht=True,
    grad_rounding="stochastic",
)
"""NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149): E2M1 in 16-blocks with E4M3 scales and
a float32 tensor scale for every operand, 16x16 weight tiles, the random Hadamard transform on
the weight-gradient GEMM and stochastic rounding of gradients. (The paper also keeps the last
layers in higher precision: ``quantize_model(..., keep_last=N)``.)"""

MXFP4 = Recipe(
    fwd="mxfp4",
    grad="mxfp4",
    weight_tile=(32, 32),
    rht=True,
    grad_rounding="stochastic",
)
"""The same recipe in MXFP4: E2M1 in 32-blocks with E8M0 scales (rceil), 32x32 weight tiles,
the random Hadamard transform on the weight-gradient GEMM and stochastic rounding of
gradients."""

FP8_TENSORWISE = Recipe(fwd="fp8_e4m3_tensor", grad="fp8_e5m2_tensor", scale_mode="fp32")
"""torchao's float8 tensorwise recipe: one float32 scale per tensor (``448 / amax`` for E4M3
activations and weights, ``57344 / amax`` for E5M2 gradients), current scaling. One quantization
of each operand serves all three GEMMs."""

FP8_ROWWISE = Recipe(fwd="fp8_e4m3_row", grad="fp8_e4m3_row", scale_mode="pow2")
"""torchao's float8 rowwise recipe: E4M3 everywhere, one power-of-two float32 scale per row
along each GEMM's reduction axis."""

FP8_ROWWISE_GW_HP = FP8_ROWWISE.replace(wgrad="high_precision")
"""torchao's ``rowwise_with_gw_hp``: :data:`FP8_ROWWISE` with the weight-gradient GEMM in high
precision on the unquantized output gradient and lhs."""
