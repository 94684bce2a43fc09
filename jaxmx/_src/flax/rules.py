"""Which layers a model conversion touches: path patterns shared by the linen and nnx converters.

A layer's path is its module names joined with ``/`` (``"blocks/0/mlp/up"``). A pattern
(``fnmatch`` syntax) matches a layer if it matches the whole path or any single component.

Example:
    >>> from jaxmx._src.flax.rules import matcher
    >>> excluded = matcher(("*embed*", "head"), default=False)
    >>> excluded("blocks/0/mlp/up", None), excluded("head", None), excluded("tok_embed", None)
    (False, True, True)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

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


def unmatched_includes(include: Rule, paths: Iterable[str]) -> list[str]:
    """The include patterns that match none of ``paths`` (none for ``None`` or a predicate)."""
    if include is None or callable(include):
        return []
    paths = list(paths)
    return [p for p in patterns(include) if not any(matches(path, (p,)) for path in paths)]
