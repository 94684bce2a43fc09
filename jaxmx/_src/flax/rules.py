"""Which layers a model conversion touches, and the recipe each gets: shared by the linen and
nnx converters.

A layer's path is its module names joined with ``/`` (``"blocks/0/mlp/up"``). A pattern
(``fnmatch`` syntax) matches a layer if it matches the whole path or any single component.
A numbered block is the first path component that is an integer or ends in ``_<int>``
(``blocks/3``, ``decoder/layers_3``, ``block_3``); :class:`Conversion` keeps the last blocks
of each stack in a higher-precision recipe.

Example:
    >>> from jaxmx._src.flax.rules import block_of, matcher
    >>> excluded = matcher(("*embed*", "head"), default=False)
    >>> excluded("blocks/0/mlp/up", None), excluded("head", None), excluded("tok_embed", None)
    (False, True, True)
    >>> block_of("blocks/3/mlp/up"), block_of("decoder/layers_12/attn"), block_of("head")
    (('blocks/', 3), ('decoder/layers_', 12), None)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxmx._src.core.recipes import Recipe, check_recipe

Rule = str | Iterable[str] | Callable[[str, Any], bool] | None
"""``None``, pattern(s), or a predicate ``(path, layer) -> bool``."""

DEFAULT_EXCLUDE: tuple[str, ...] = ("*embed*", "head", "*_head", "logits", "classifier")
"""Layer-path patterns the converters leave in high precision unless told otherwise.

Embeddings (tied or not) and the output head stay in high precision, as in NVIDIA's MXFP8 and
DeepSeek-V3's FP8 recipes.
"""


def patterns(rule: Rule) -> tuple[str, ...]:
    """The patterns of a pattern rule (one string, or several)."""
    return (rule,) if isinstance(rule, str) else tuple(rule)


def matches(path: str, pats: tuple[str, ...]) -> bool:
    """Whether any pattern matches ``path`` or one of its ``/``-separated components."""
    parts = path.split("/")
    return any(
        fnmatch.fnmatchcase(path, p) or any(fnmatch.fnmatchcase(c, p) for c in parts) for p in pats
    )


def matcher(rule: Rule, default: bool) -> Callable[[str, Any], bool]:
    """``rule`` as a predicate ``(path, layer) -> bool``; ``None`` answers ``default``."""
    if rule is None:
        return lambda path, layer: default
    if callable(rule):
        return rule
    pats = patterns(rule)
    return lambda path, layer: matches(path, pats)


def unmatched(rule: Rule, paths: Iterable[str]) -> list[str]:
    """The patterns of ``rule`` that match none of ``paths`` (none for ``None`` or a predicate)."""
    if rule is None or callable(rule):
        return []
    paths = list(paths)
    return [p for p in patterns(rule) if not any(matches(path, (p,)) for path in paths)]


_NUMBERED = re.compile(r"(.*_)?(\d+)")  # a block component: "3", "layers_3"
_BLOCK_FORMS = "a path component that is an integer or ends in _<int>: blocks/0, layers_0, block_0"


def block_of(path: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the numbered block ``path`` lies in, or ``None``.

    The block is the first component that is an integer or ends in ``_<int>``; its prefix is
    the path up to it plus its name stem (``"blocks/"``, ``"decoder/layers_"``), which tells
    the stacks of a model apart.
    """
    parts = path.split("/")
    for i, part in enumerate(parts):
        m = _NUMBERED.fullmatch(part)
        if m:
            return "/".join([*parts[:i], m.group(1) or ""]), int(m.group(2))
    return None


def last_blocks(paths: Iterable[str], n: int) -> frozenset[tuple[str, int]]:
    """The ``n`` highest-numbered blocks of each stack (prefix) among ``paths``.

    Raises:
        ValueError: ``n > 0`` and no path lies in a numbered block, or a stack has fewer than
            ``n`` blocks.
    """
    if n == 0:
        return frozenset()
    paths = list(paths)
    stacks: dict[str, set[int]] = {}
    for path in paths:
        block = block_of(path)
        if block is not None:
            stacks.setdefault(block[0], set()).add(block[1])
    if not stacks:
        raise ValueError(
            f"quantize_model: keep_last={n} needs numbered blocks ({_BLOCK_FORMS}), but no layer "
            f"to convert lies in one: {sorted(paths)}; use keep= patterns instead"
        )
    kept = set()
    for prefix, indices in stacks.items():
        if n > len(indices):
            raise ValueError(
                f"quantize_model: keep_last={n} is more than the {len(indices)} numbered blocks "
                f"under {prefix!r} ({prefix}{min(indices)} .. {prefix}{max(indices)})"
            )
        kept.update((prefix, i) for i in sorted(indices)[-n:])
    return frozenset(kept)


@dataclasses.dataclass
class Conversion:
    """The arguments of a ``quantize_model`` call: which layers it converts, and to what.

    A layer is converted if ``include`` matches it and ``exclude`` does not. It gets
    ``keep_recipe`` if ``keep`` matches it or it lies in one of the ``keep_last``
    highest-numbered blocks of its stack (:func:`last_blocks`, over the converted layers),
    else ``recipe``.

    Example:
        >>> from jaxmx._src.core.recipes import MXFP8
        >>> conv = Conversion(MXFP8, keep_last=1)
        >>> plan = conv.plan(dict.fromkeys(["blocks/0/up", "blocks/1/up", "proj"]))
        >>> {path: recipe is MXFP8 for path, recipe in plan.items()}
        {'blocks/0/up': True, 'blocks/1/up': False, 'proj': True}
    """

    recipe: Recipe | None
    include: Rule = None
    exclude: Rule = DEFAULT_EXCLUDE
    keep: Rule = None
    keep_last: int = 0
    keep_recipe: Recipe | None = None
    _included: Callable = dataclasses.field(init=False, repr=False)
    _excluded: Callable = dataclasses.field(init=False, repr=False)
    _kept: Callable = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        check_recipe(self.recipe, "quantize_model", optional=True)
        check_recipe(self.keep_recipe, "quantize_model", name="keep_recipe", optional=True)
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(
                "quantize_model: keep_last must be an integer >= 0 (the number of final blocks "
                f"to keep), got {self.keep_last!r}"
            )
        self._included = matcher(self.include, default=True)
        self._excluded = matcher(self.exclude, default=False)
        self._kept = matcher(self.keep, default=False)

    def converts(self, path: str, layer: Any) -> bool:
        """Whether ``include`` matches the layer and ``exclude`` does not."""
        return self._included(path, layer) and not self._excluded(path, layer)

    def recipe_of(self, path: str, layer: Any, kept_blocks: frozenset) -> Recipe | None:
        """The recipe of a converted layer, given the kept blocks (:func:`last_blocks`)."""
        kept = self._kept(path, layer) or block_of(path) in kept_blocks
        return self.keep_recipe if kept else self.recipe

    def plan(self, converted: Mapping[str, Any]) -> dict[str, Recipe | None]:
        """``{path: recipe}`` of the converted layers ``{path: layer}``."""
        blocks = last_blocks(converted, self.keep_last)
        return {path: self.recipe_of(path, layer, blocks) for path, layer in converted.items()}

    def check_patterns(self, layers: Iterable[str], converted: Iterable[str], kinds: str) -> None:
        """Raises a ValueError for an ``include`` pattern that matches none of the convertible
        ``layers`` (``kinds``: their types, for the message), or a ``keep`` pattern that matches
        none of the ``converted`` ones."""
        layers, converted = sorted(layers), sorted(converted)
        missing = unmatched(self.include, layers)
        if missing:
            raise ValueError(
                f"quantize_model: include pattern {missing[0]!r} matches no {kinds} layer; "
                f"the model has {layers}"
            )
        missing = unmatched(self.keep, converted)
        if missing:
            raise ValueError(
                f"quantize_model: keep pattern {missing[0]!r} matches no converted layer; "
                f"the converted layers are {converted}"
            )
