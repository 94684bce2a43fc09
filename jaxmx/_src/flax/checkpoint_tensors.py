"""A Flax parameter from its checkpoint tensor and back, shared by the linen and nnx
``load_checkpoint`` / ``export_checkpoint``, and :class:`CheckpointReport`, what a load did.

Loading, a parameter takes its tensor decoded (an MXArray: ``dequantize``\\ d to the parameter's
dtype), cast, and transposed for a kernel (``[out, in]`` to ``[in, out]``, reshaped to a kernel
of more axes); a parameter that holds an MXArray (weights at rest) takes the tensor's MXArray as
it is. Exporting, a kernel whose tensor was an MXArray is quantized against that MXArray's
scales (:func:`jaxmx.requantize`: the bytes of unchanged weights come back), one with no
quantized tensor to follow is quantized afresh in the scheme's layout, and the rest are written
in their tensor's dtype.

Example:
    >>> report = CheckpointReport(
    ...     loaded={"up/kernel": Loaded(tensor="up.weight", how="dequantized",
    ...                                 stored="mxfp8_e4m3")},
    ...     unused=("up.input_scale",))
    >>> report.activation_scales
    ('up.input_scale',)
    >>> print(report)
    up/kernel  up.weight  dequantized  mxfp8_e4m3
    unused activation scales (jaxmx scales activations at run time): up.input_scale
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp

from jaxmx._src.checkpoints.directory import Checkpoint, save
from jaxmx._src.checkpoints.fresh import quantized_weight
from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.checkpoints.scheme import Scheme
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.flax.checkpoint_names import NameMap, Path, path_string, tensor_names
from jaxmx._src.flax.rules import matching
from jaxmx._src.quantize.quantize import dequantize
from jaxmx._src.quantize.requantize import requantize

HOW = ("dequantized", "at rest", "copied")
"""How a parameter took its tensor: an MXArray decoded to master weights, an MXArray kept as it
is (weights at rest), a high-precision tensor cast to the parameter's dtype."""

ACTIVATION_SCALES = (
    "input_scale",
    "input_global_scale",
    "output_scale",
    "q_scale",
    "k_scale",
    "v_scale",
    "kv_scale",
    "prob_scale",
)
"""The last name components of the static activation scales that FP8 / NVFP4 checkpoints ship
for their peers' kernels (calibrated inputs of each Linear, the KV cache's scales). A Flax model
has no parameter for them: a load lists them as unused, without a warning, and an export against
the checkpoint (in its scheme) writes them back unchanged: they were calibrated for its weights,
so recalibrate them after training that changes the weights much."""

DEFAULT_EXPORT_EXCLUDE = ("lm_head", "gate", "*router*")
"""The modules ``export_checkpoint`` leaves unquantized when it quantizes afresh: the output head
and MoE routers (DeepSeek's and Qwen's ``mlp.gate``, ``router``), as the FP8 / FP4 checkpoints
of those models do. Embeddings and norms are never quantized (they are not Linear kernels)."""

Exclude = Iterable[str] | Callable[[str], bool]
_TENSOR_SCALES = (".weight_global_scale", ".weight_scale_2")  # compressed-tensors, ModelOpt


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loaded:
    """How one parameter was loaded: from the tensor ``tensor``, ``how`` (one of :data:`HOW`),
    stored as ``stored`` (the MXArray's format and tiles, or the tensor's dtype)."""

    tensor: str
    how: str
    stored: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointReport:
    """What ``load_checkpoint`` did: ``loaded`` maps each parameter's path (joined with ``/``)
    to how it was loaded, in the model's order; ``unused`` lists the checkpoint's tensors that
    no parameter took, in the checkpoint's order (those of :data:`ACTIVATION_SCALES`:
    :attr:`activation_scales`). ``print(report)`` shows both."""

    loaded: Mapping[str, Loaded]
    unused: tuple[str, ...] = ()

    @property
    def activation_scales(self) -> tuple[str, ...]:
        """The unused tensors that are static activation scales (not needed by jaxmx)."""
        return tuple(name for name in self.unused if _is_activation_scale(name))

    @property
    def unexpected(self) -> tuple[str, ...]:
        """The unused tensors that are not activation scales (``load_checkpoint`` warns)."""
        return tuple(name for name in self.unused if not _is_activation_scale(name))

    def __str__(self) -> str:
        rows = [[path, x.tensor, x.how, x.stored] for path, x in self.loaded.items()]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
        lines = [
            "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[3]]) for r in rows
        ]
        if self.unexpected:
            lines.append("unused: " + ", ".join(self.unexpected))
        if self.activation_scales:
            lines.append(
                "unused activation scales (jaxmx scales activations at run time): "
                + ", ".join(self.activation_scales)
            )
        return "\n".join(line.rstrip() for line in lines)


def _is_activation_scale(name: str) -> bool:
    return name.rpartition(".")[2] in ACTIVATION_SCALES


def stored_label(tensor) -> str:
    """An MXArray's format and tiles, or an array's dtype."""
    if isinstance(tensor, MXArray):
        return tensor.fmt + (f" {tensor.tile[0]}x{tensor.tile[1]} tiles" if tensor.tile else "")
    return jnp.dtype(tensor.dtype).name


# --- loading -------------------------------------------------------------------------------------


def tensor_of(checkpoint: Checkpoint, path: Path, name: str, caller: str):
    """The tensor ``name`` of the parameter at ``path``, or a CheckpointError naming both."""
    if name in checkpoint.tensors:
        return checkpoint.tensors[name]
    close = difflib.get_close_matches(name, list(checkpoint.tensors), n=3)
    hint = f"; close names: {close}" if close else ""
    raise CheckpointError(
        f"{caller}: parameter {path_string(path)!r} has no tensor {name!r} in the checkpoint"
        f"{hint} (pass names= to map it)"
    )


def loaded_value(path: Path, name: str, transposed: bool, tensor, current, caller: str):
    """``(value, how)``: the value of the parameter at ``path`` (whose value now is ``current``:
    an array, a ``ShapeDtypeStruct`` or an MXArray) from its tensor."""
    check_loadable(path, name, transposed, tensor, current, caller)
    if isinstance(current, MXArray):
        return tensor, "at rest"
    shape, dtype = tuple(current.shape), jnp.dtype(current.dtype)
    if isinstance(tensor, MXArray):
        decode = dtype if dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.float32
        value, how = dequantize(tensor, decode).astype(dtype), "dequantized"
    else:
        value, how = jnp.asarray(tensor).astype(dtype), "copied"
    value = (value.T if transposed else value).reshape(shape)
    sharding = getattr(current, "sharding", None)
    if sharding is not None and sharding != value.sharding:  # sharded, or on another device
        value = jax.device_put(value, sharding)
    return value, how


def check_loadable(path: Path, name: str, transposed: bool, tensor, current, caller: str) -> None:
    """Raises a CheckpointError naming the parameter and the tensor unless the parameter at
    ``path`` (valued ``current``) can take ``tensor``: of its shape (transposed: see
    :func:`param_shape`), or, for a parameter holding an MXArray, an MXArray of the same shape,
    format and tiles."""
    if isinstance(current, MXArray):
        _check_at_rest(path, name, tensor, current, caller)
    elif param_shape(tuple(tensor.shape), tuple(current.shape), transposed) is None:
        raise _shape_error(path, name, tensor, tuple(current.shape), transposed, caller)


def _check_at_rest(path: Path, name: str, tensor, current: MXArray, caller: str) -> None:
    if not isinstance(tensor, MXArray):
        raise CheckpointError(
            f"{caller}: parameter {path_string(path)!r} holds a weight at rest ({current.fmt}), "
            f"but the tensor {name!r} is not quantized ({stored_label(tensor)}); load into a "
            "model whose layer is not converted"
        )
    if tensor.shape != current.shape or (tensor.fmt, tensor.tile) != (current.fmt, current.tile):
        raise CheckpointError(
            f"{caller}: parameter {path_string(path)!r} holds {list(current.shape)} "
            f"{stored_label(current)}, but the tensor {name!r} is {list(tensor.shape)} "
            f"{stored_label(tensor)}"
        )


def param_shape(tensor_shape: tuple, shape: tuple, transposed: bool) -> tuple | None:
    """``shape`` if a tensor of ``tensor_shape`` is the parameter's (transposed: a 2-D ``[out,
    in]`` tensor whose transpose ``[in, out]`` reshapes to ``shape``, ``[*in axes, *out axes]``),
    else ``None``."""
    if not transposed:
        return shape if tensor_shape == shape else None
    if len(tensor_shape) != 2:
        return None
    n, k = tensor_shape
    return shape if (k, n) == shape or _split(shape, k, n) else None


def _split(shape: tuple, k: int, n: int) -> bool:
    """Whether ``shape`` is ``[*in, *out]`` with ``prod(in) == k`` and ``prod(out) == n``."""
    return any(
        math.prod(shape[:i]) == k and math.prod(shape[i:]) == n for i in range(1, len(shape))
    )


def _shape_error(path: Path, name: str, tensor, shape: tuple, transposed: bool, caller: str):
    seen = f"{list(tensor.shape)}"
    if transposed and len(tensor.shape) == 2:
        seen += f" (transposed: {list(tensor.shape[::-1])})"
    return CheckpointError(
        f"{caller}: parameter {path_string(path)!r} has shape {list(shape)}, but its tensor "
        f"{name!r} is {seen}"
    )


def unused_tensors(checkpoint: Checkpoint, taken: Iterable[str], caller: str) -> tuple[str, ...]:
    """The checkpoint's tensors not in ``taken``; a warning names those that are not activation
    scales."""
    taken = set(taken)
    kept = kept_tensor_scales(checkpoint.tensors)
    taken |= {kept[w] for w in taken if w in kept}
    unused = tuple(name for name in checkpoint.tensors if name not in taken)
    unexpected = [name for name in unused if not _is_activation_scale(name)]
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (", ..." if len(unexpected) > 8 else "")
        warnings.warn(
            f"{caller}: {len(unexpected)} checkpoint tensor(s) that no parameter of the model "
            f"took: {shown} (report.unused lists them)",
            stacklevel=3,
        )
    return unused


# --- exporting -----------------------------------------------------------------------------------


def write_checkpoint(
    params: Iterable[tuple[Path, object]],
    path,
    *,
    like: Checkpoint | None,
    scheme: Scheme | None,
    names: NameMap,
    config,
    exclude: Exclude,
    dtype,
) -> None:
    """``export_checkpoint`` of both Flax APIs on ``params`` (``(path, value)`` pairs): each
    under its tensor name, ``scheme`` and ``config`` defaulting to ``like``'s, written with
    :func:`jaxmx.checkpoints.save`."""
    caller = "export_checkpoint"
    params = list(params)
    mapping = tensor_names([p for p, _ in params], names, caller)
    scheme = like.scheme if scheme is None and like is not None else scheme
    tensors = exported_tensors(
        params, mapping, like=like, scheme=scheme, exclude=exclude, dtype=dtype, caller=caller
    )
    config = like.config if config is None and like is not None else config
    save(path, tensors, scheme, config=config)


def exported_tensors(
    params: Iterable[tuple[Path, object]],
    names: Mapping[Path, tuple[str, bool]],
    *,
    like: Checkpoint | None,
    scheme: Scheme | None,
    exclude: Exclude,
    dtype,
    caller: str,
) -> dict:
    """``{tensor name: MXArray | array}`` of the parameters ``(path, value)`` for
    :func:`jaxmx.checkpoints.save`, in ``like``'s order where it has the tensor."""
    excluded = _excluded(exclude, caller)
    keep = like is not None and scheme is not None and scheme == like.scheme
    out, owner = {}, {}
    for path, value in params:
        name, transposed = names[path]
        if name in owner:
            raise CheckpointError(
                f"{caller}: parameters {path_string(owner[name])!r} and {path_string(path)!r} "
                f"both map to the tensor {name!r}"
            )
        owner[name] = path
        ref = None if like is None else like.tensors.get(name)
        out[name] = _exported(
            path,
            name,
            value,
            transposed,
            ref,
            keep=keep,
            scheme=scheme,
            excluded=excluded,
            dtype=dtype,
            caller=caller,
        )
    if like is None:
        return out
    kept = kept_tensor_scales(like.tensors)
    carried = {
        n: like.tensors[n]
        for n in (kept[w] for w in kept if isinstance(out.get(w), MXArray))
        if keep and n not in out
    }
    if keep:
        carried.update({n: v for n, v in like.tensors.items() if _is_activation_scale(n)})
    order = [n for n in like.tensors if n in out or n in carried]
    return {**{n: out.get(n, carried.get(n)) for n in order}, **out}


def kept_tensor_scales(tensors: Mapping) -> dict[str, str]:
    """``{weight name: tensor name}`` of the NVFP4 tensor scales :func:`jaxmx.checkpoints.load`
    keeps beside their MXArray, as stored (a compressed-tensors encode factor whose float32
    reciprocal does not convert back to it): part of their weight, written back with it."""
    out = {}
    for name, value in tensors.items():
        for suffix in _TENSOR_SCALES:
            weight = name.removesuffix(suffix) + ".weight"
            if name.endswith(suffix) and not isinstance(value, MXArray):
                if isinstance(tensors.get(weight), MXArray):
                    out[weight] = name
    return out


def _exported(path, name, value, transposed, ref, *, keep, scheme, excluded, dtype, caller):
    if isinstance(value, MXArray):  # weights at rest: written as they are
        if ref is not None and tuple(ref.shape) != value.shape:
            raise _export_shape_error(path, name, value.shape, ref, caller)
        return value
    w = _as_tensor(path, name, jnp.asarray(value), transposed, ref, caller)
    if ref is not None and tuple(ref.shape) != tuple(w.shape):
        raise _export_shape_error(path, name, w.shape, ref, caller)
    if isinstance(ref, MXArray) and keep:
        return requantize(w, ref)
    fresh = ref is None or isinstance(ref, MXArray)  # a quantized tensor in another scheme
    if transposed and fresh and scheme is not None and not excluded(name.removesuffix(".weight")):
        return quantized_weight(w, scheme, name)
    if dtype is None:
        dtype = ref.dtype if ref is not None and not isinstance(ref, MXArray) else w.dtype
    return w.astype(dtype)


def _as_tensor(path, name, value: jax.Array, transposed: bool, ref, caller: str) -> jax.Array:
    """The parameter's value in its tensor's orientation (a kernel ``[*in, *out]`` as ``[out,
    in]``)."""
    if not transposed:
        return value
    if value.ndim == 2:
        return value.T
    if ref is not None and len(ref.shape) == 2 and _split(value.shape, ref.shape[1], ref.shape[0]):
        return value.reshape(ref.shape[1], ref.shape[0]).T
    raise CheckpointError(
        f"{caller}: kernel {path_string(path)!r} has shape {list(value.shape)}; the [out, in] "
        f"shape of its tensor {name!r} is known only from like= (a checkpoint that has it)"
    )


def _export_shape_error(path, name, shape, ref, caller):
    return CheckpointError(
        f"{caller}: parameter {path_string(path)!r} gives the tensor {name!r} shape "
        f"{list(shape)}, but like's {name!r} is {list(ref.shape)}"
    )


def _excluded(exclude: Exclude, caller: str) -> Callable[[str], bool]:
    """``exclude`` as a predicate on Hugging Face module names (``"lm_head"``,
    ``"model.layers.0.mlp.gate"``); patterns match the whole name or a run of its dotted
    components."""
    if callable(exclude):
        return exclude
    pats = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(
            f"{caller}: exclude must be module names / patterns or a predicate name -> bool, "
            f"got {exclude!r}"
        )
    pats = tuple(p.replace(".", "/") for p in pats)
    return lambda module: matching(module.replace(".", "/"), pats) is not None
