"""Weights at rest in the Flax layers: what the linen and nnx ``quantize_weights`` share.

:class:`WeightStorage` (the format, tile and mode of a converted layer), a layer's kernel stored
through :func:`~jaxmx.store_weight` (the ``[N, K]`` MXArray quantized along K) and a Dense /
DenseGeneral layer's forward through :func:`~jaxmx.weight_matmul` (forward only: a gradient
through it raises), with errors naming the layer; the conversion's rules.

Example:
    >>> import jax, jax.numpy as jnp
    >>> storage = WeightStorage(fmt="mxfp8_e4m3")
    >>> w = stored_weight(jnp.ones((64, 8)), (-1,), (8,), storage, "up")
    >>> w.shape, w.axis, storage.label
    ((8, 64), 1, 'mxfp8_e4m3, weights only')
    >>> dense_forward(jnp.ones((2, 64)), w, None, axes=(-1,), features=(8,), storage=storage,
    ...               dtype=jnp.float32).tolist()[0][:2]
    [64.0, 64.0]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.formats import check_gemm_operand, get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.flax.rules import Conversion, Rule
from jaxmx._src.serving.stored_weights import store_weight, weight_matmul


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightStorage:
    """How ``quantize_weights`` stores and uses a converted layer's kernel.

    Attributes:
        fmt: a format of :data:`jaxmx.FORMATS` (``"mxfp8_e4m3"``, ``"mxfp4"``, ``"nvfp4"``,
            ``"fp8_e4m3_block"``, ...).
        tile: ``None`` (1-D blocks along K) or ``(rows, cols)``: one scale per tile of the
            ``[N, K]`` weight (NVFP4 ``(16, 16)``, block FP8 ``(128, 128)``).
        activations: ``False``: weight-only (W8A16 / W4A16); ``True``: the activations are
            quantized too (W8A8 / W4A4).
    """

    fmt: str
    tile: tuple[int, int] | None = None
    activations: bool = False

    def __post_init__(self):
        f = check_gemm_operand(get_format(self.fmt), "WeightStorage.fmt")
        object.__setattr__(self, "fmt", f.name)
        if self.tile is not None:
            tile = tuple(self.tile) if isinstance(self.tile, (tuple, list)) else None
            if (
                tile is None
                or len(tile) != 2
                or not all(isinstance(t, int) and t > 0 for t in tile)
            ):
                raise ValueError(
                    f"quantize_weights: tile must be None or (rows, cols) of positive ints, got "
                    f"{self.tile!r}"
                )
            object.__setattr__(self, "tile", tile)
        if not isinstance(self.activations, bool):
            raise TypeError(
                f"quantize_weights: activations must be a bool, got {self.activations!r}"
            )

    @property
    def label(self) -> str:
        """The report's description of the stored weight."""
        tile = f" {self.tile[0]}x{self.tile[1]} tiles" if self.tile else ""
        mode = "weights and activations" if self.activations else "weights only"
        return f"{self.fmt}{tile}, {mode}"


def stored_weight(
    kernel: jax.Array,
    axes: tuple[int, ...],
    features: tuple[int, ...],
    storage: WeightStorage,
    path: str,
) -> MXArray:
    """``kernel [*in, *features]`` of the layer at ``path``, which contracts ``len(axes)`` input
    dims, as the ``[N, K]`` MXArray quantized along K."""
    n_in = len(axes)
    if kernel.ndim != n_in + len(features) or tuple(kernel.shape[n_in:]) != features:
        raise ValueError(
            f"quantize_weights: layer {path!r} has a kernel of shape {tuple(kernel.shape)}, not "
            f"[{n_in} contracted dims, *{features}] (a layer under a lifted transform such as "
            "scan or vmap, whose kernel is stacked, is not supported: exclude it)"
        )
    return store_weight(kernel, storage.fmt, tile=storage.tile, contracting=n_in)


def dense_forward(
    x: jax.Array,
    w: MXArray,
    bias: jax.Array | None,
    *,
    axes: tuple[int, ...],
    features: tuple[int, ...],
    storage: WeightStorage,
    dtype,
) -> jax.Array:
    """A Dense / DenseGeneral layer on its stored weight: ``x`` contracted over ``axes`` with the
    ``[N, K]`` weight ``w``, the result ``[*other dims of x, *features]`` in ``dtype``, plus
    ``bias``. The input and ``dtype`` must be floating point (a TypeError naming them)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"quantize_weights: the layer's input must be a floating-point array, got {x.dtype} "
            "(cast it, e.g. x.astype(jnp.float32), or embed integer ids first)"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"quantize_weights: the layer's dtype must be floating point, got {dtype}")
    axes = tuple(normalize_axis(a, x.ndim) for a in axes)
    x = jnp.moveaxis(x, axes, range(x.ndim - len(axes), x.ndim))
    batch, k = x.shape[: x.ndim - len(axes)], math.prod(x.shape[x.ndim - len(axes) :])
    if (k, math.prod(features)) != (w.shape[1], w.shape[0]):
        raise ValueError(
            f"quantize_weights: the layer contracts K = {k} into N = {math.prod(features)} "
            f"features, but its stored weight is [N, K] = {list(w.shape)}"
        )
    y = weight_matmul(x.reshape(-1, k), w, activations=storage.activations, dtype=dtype)
    y = y.reshape(*batch, *features)
    return y if bias is None else y + jnp.asarray(bias, dtype)


def kernel_sizes(kernel, stored: MXArray | None) -> tuple[int, int]:
    """``(bytes as stored, bytes in bfloat16)`` of a kernel (``stored``: its MXArray, if
    converted)."""
    nbytes = stored.nbytes if stored is not None else kernel.size * jnp.dtype(kernel.dtype).itemsize
    return nbytes, kernel.size * 2


def hook_refusal(layer) -> str | None:
    """Why ``layer`` (a Flax Linear / Dense) is not converted when it sets its own GEMM hook
    (``dot_general`` or ``dot_general_cls``, e.g. a :func:`quantize_model` conversion), which
    its stored weight's GEMM would bypass; ``None`` when it keeps Flax's default."""
    if getattr(layer, "dot_general", None) in (None, lax.dot_general) and (
        getattr(layer, "dot_general_cls", None) is None
    ):
        return None
    return (
        "not converted: the layer sets its own dot_general / dot_general_cls, which its stored "
        "weight's GEMM would bypass; exclude it or drop the hook"
    )


def weights_conversion(*, include: Rule, exclude: Rule, exclude_defaults: bool) -> Conversion:
    """The layer rules of ``quantize_weights`` (both Flax APIs): ``quantize_model``'s patterns
    and defaults, with no training recipe, its errors naming ``quantize_weights``."""
    return Conversion(
        recipe=None,
        include=include,
        exclude=exclude,
        exclude_defaults=exclude_defaults,
        caller="quantize_weights",
    )
