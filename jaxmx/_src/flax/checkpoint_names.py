"""The names of a Flax model's parameters in a Hugging Face checkpoint: :func:`hf_name`, and the
map of a whole model (:func:`tensor_names`) from it or from a user's own map.

A Flax parameter path such as ``('model', 'layers', 0, 'self_attn', 'q_proj', 'kernel')`` names
the tensor ``model.layers.0.self_attn.q_proj.weight``. A Linear's ``kernel`` is ``[in, out]``,
the transpose of the ``[out, in]`` torch weight; every other parameter is stored as it is.

Example:
    >>> hf_name(("model", "layers", 0, "self_attn", "q_proj", "kernel"))
    ('model.layers.0.self_attn.q_proj.weight', True)
    >>> hf_name(("model", "layers_1", "input_layernorm", "scale"))
    ('model.layers.1.input_layernorm.weight', False)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from jaxmx._src.checkpoints.safetensors_files import CheckpointError

Path = tuple[str | int, ...]
NameMap = Callable[[Path], tuple[str, bool]] | Mapping[str, str]
"""A map of parameter paths to tensor names: a function ``path -> (tensor name, transposed)``
(as :func:`hf_name`), or ``{"a/b/0/kernel": "a.b.0.weight"}`` (a parameter's path joined with
``/``; transposed when the parameter is named ``kernel``), whose entries take the place of
:func:`hf_name`'s for the parameters they name."""

_PARAMS = {
    "kernel": ("weight", True),  # nnx.Linear / nn.Dense: [in, out], torch [out, in]
    "embedding": ("weight", False),  # nnx.Embed / nn.Embed: [vocab, features], as torch
    "scale": ("weight", False),  # RMSNorm / LayerNorm
    "bias": ("bias", False),
}
_LINEN_NUMBERED = re.compile(r"([A-Za-z][A-Za-z_]*?)_(\d+)")  # linen's "layers_0"


def hf_name(path: Path) -> tuple[str, bool]:
    """The Hugging Face tensor name of the Flax parameter at ``path``, and whether the tensor is
    the transpose of the parameter.

    The modules' names are kept, joined with ``.``; a linen list entry ``layers_0`` (a name
    ending in ``_<int>``) becomes ``layers.0``, as an nnx list's ``('layers', 0)`` does. The
    parameter's name maps to torch's: ``kernel`` to ``weight`` (transposed), ``embedding`` and
    ``scale`` (norms) to ``weight``, ``bias`` to ``bias``; any other name is kept.

    This covers the Llama, Qwen, Mistral and DeepSeek families (and other transformers models)
    when the Flax model mirrors their attribute names (``model.layers[i].self_attn.q_proj``,
    ``mlp.gate_proj``, ``input_layernorm``, ``model.embed_tokens``, ``lm_head``...), with
    projections as ``Linear`` / ``Dense`` layers of ``[in, out]`` kernels. A model laid out
    otherwise (fused QKV, heads as kernel axes, stacked layers) needs its own map.

    Example:
        >>> hf_name(("model", "embed_tokens", "embedding"))
        ('model.embed_tokens.weight', False)
        >>> hf_name(("lm_head", "kernel"))
        ('lm_head.weight', True)
    """
    if not path:
        raise ValueError("hf_name: an empty parameter path")
    *modules, param = path
    parts = []
    for part in modules:
        m = _LINEN_NUMBERED.fullmatch(part) if isinstance(part, str) else None
        parts.extend(m.groups() if m else (str(part),))
    name, transposed = _PARAMS.get(str(param), (str(param), False))
    return ".".join([*parts, name]), transposed


def path_string(path: Path) -> str:
    """``path`` joined with ``/``, as reports and name maps write it."""
    return "/".join(str(p) for p in path)


def tensor_names(
    paths: Iterable[Path], names: NameMap, caller: str
) -> dict[Path, tuple[str, bool]]:
    """``{path: (tensor name, transposed)}`` of every parameter path under ``names``; a
    dict's key that names no parameter raises."""
    paths = list(paths)
    if callable(names):
        return {path: _checked(names(path), path, caller) for path in paths}
    if not isinstance(names, Mapping):
        raise TypeError(
            f"{caller}: names must be a function path -> (tensor name, transposed) or a dict "
            f"{{'a/b/kernel': 'a.b.weight'}}, got {type(names).__name__}"
        )
    strings = {path_string(path): path for path in paths}
    unknown = sorted(set(names) - set(strings))
    if unknown:
        raise CheckpointError(
            f"{caller}: names maps {unknown} but the model has no such parameters (paths are "
            f"joined with '/', e.g. {next(iter(strings), 'a/b/kernel')!r})"
        )
    out = {}
    for s, path in strings.items():
        if s in names:
            out[path] = _checked((names[s], str(path[-1]) == "kernel"), path, caller)
        else:
            out[path] = hf_name(path)
    return out


def _checked(found, path: Path, caller: str) -> tuple[str, bool]:
    if (
        not isinstance(found, tuple)
        or len(found) != 2
        or not isinstance(found[0], str)
        or not isinstance(found[1], bool)
    ):
        raise TypeError(
            f"{caller}: names gave {found!r} for the parameter {path_string(path)!r}; expected "
            "(tensor name, transposed: bool)"
        )
    return found
