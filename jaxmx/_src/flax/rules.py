"""Which layers a model conversion touches, the recipe each gets, and the report that lists it:
shared by the linen and nnx converters.

A layer's path is its module names joined with ``/`` (``"blocks/0/mlp/up"``). A pattern
(``fnmatch`` syntax) matches a layer if it matches the whole path or any run of consecutive
components (``"attn/*"`` matches ``"blocks/0/attn/key"``, ``"head"`` matches
``"decoder/head"``). A numbered block is the first path component that is an integer or ends in
``_<int>`` (``blocks/3``, ``decoder/layers_3``, ``block_3``); :class:`Conversion` can keep the
last blocks of each stack in another recipe.

Example:
    >>> from jaxmx._src.flax.rules import block_of, matching
    >>> matching("blocks/0/attn/key", ("attn/*", "head")), matching("tok_embed", ("*embed*",))
    ('attn/*', '*embed*')
    >>> block_of("blocks/3/mlp/up"), block_of("decoder/layers_12/attn"), block_of("head")
    (('blocks/', 3), ('decoder/layers_', 12), None)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from jaxmx._src.core.recipes import (
    Recipe,
    check_recipe,
)
from jaxmx._src.flax.conversion_report import ConversionReport, LayerPlan

Rule = str | Iterable[str] | Callable[[str, Any], bool] | None
"""``None``, pattern(s), or a predicate ``(path, layer) -> bool``."""

DEFAULT_EXCLUDE: tuple[str, ...] = (
    "*embed*",
    "head",
    "*_head",
    "*logit*",
    "classifier",
    "*router*",
    "gate",
)
"""Layer-path patterns the converters leave in high precision by default.

Embeddings, output heads (``head``, ``lm_head``, ``logits``, lm1b's ``logitdense``, a
``classifier``) and MoE routers (``router``, DeepSeek's ``gate``) stay in high precision, as in
NVIDIA's MXFP8 and DeepSeek-V3's FP8 recipes. Besides these names, the output head by position
stays in high precision too, whatever its name: in linen the model's last projection, in nnx
(which has no call order) its only projection, when its output width is the size of one of the
model's embedding tables.
"""

# What a layer is to a converter.
GEMM = "gemm"  # a layer whose GEMM the converter can route through jaxmx
EXPERTS = "experts"  # a layer holding an MXRaggedDot (grouped expert GEMMs)
ATTENTION = "attention"  # an attention layer whose products attention=True converts
EMBEDDING = "embedding"  # an embedding table (lookup / tied output projection): never converted
OWN = "own"  # a jaxmx layer, which keeps the recipe it was built with
REFUSED = "refused"  # a layer this converter cannot convert (Layer.note says why)


def _components_runs(path: str) -> Iterator[str]:
    parts = path.split("/")
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            yield "/".join(parts[i:j])


def matching(path: str, pats: Iterable[str]) -> str | None:
    """The first pattern of ``pats`` that matches ``path`` or a run of its components, or
    ``None``."""
    runs = list(_components_runs(path))
    return next((p for p in pats if any(fnmatch.fnmatchcase(r, p) for r in runs)), None)


def _is_literal(pattern: str) -> bool:
    return not any(c in pattern for c in "*?[")


def _normalized(rule: Rule, name: str, caller: str) -> tuple[str, ...] | Callable | None:
    """``rule`` as ``None``, a tuple of patterns, or a predicate; a TypeError for anything else."""
    if rule is None or callable(rule):
        return rule
    pats = (rule,) if isinstance(rule, str) else tuple(rule) if isinstance(rule, Iterable) else None
    if pats is None or not all(isinstance(p, str) for p in pats):
        raise TypeError(
            f"{caller}: {name} must be None, a pattern, a list of patterns or a predicate "
            f"(path, layer) -> bool, got {rule!r}"
        )
    return pats


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    """A layer of a model as a converter found it (in call order for linen, ``nnx.iter_modules``
    for nnx)."""

    path: str
    kind: str  # the layer's type name
    role: str  # GEMM, EXPERTS, ATTENTION, EMBEDDING or OWN
    out_width: int | None = None  # the last dimension of its output (GEMM), if known
    vocab: int | None = None  # EMBEDDING: the number of entries of its table
    recipe: Recipe | None = None  # OWN: the recipe the layer was built with
    note: str | None = None  # REFUSED: why the layer is not converted
    module: Any = dataclasses.field(default=None, compare=False, repr=False)  # for predicates


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversion:
    """The arguments of a ``quantize_model`` call: which layers it converts, and to what.

    A layer is converted unless an ``exclude`` pattern matches it, ``include`` (when given) does
    not, or a default exclusion holds (:data:`DEFAULT_EXCLUDE`, or the layer is the output
    head). An ``include`` pattern without wildcards that matches a layer (``include="head"``)
    wins over the default exclusions; the user's ``exclude`` wins over everything. A converted
    layer gets ``keep_recipe`` if ``keep`` matches it or it lies in one of the ``keep_last``
    highest-numbered blocks of its stack (:func:`last_blocks`, over the converted layers), else
    ``recipe``. ``recipe`` may also be a per-layer mapping ``{pattern: Recipe or None}`` (as
    :func:`jaxmx.diagnostics.advised_recipes` returns): a converted layer gets the recipe of the
    first pattern that matches it; a converted layer that no pattern matches raises (add a
    ``"*"`` entry for the others), as does a pattern that matches no converted layer. Frozen and
    hashable (the mapping is held as ``(pattern, recipe)`` pairs): two conversions are equal
    when they compute the same thing.

    Example:
        >>> from jaxmx._src.core.recipes import MXFP8
        >>> conv = Conversion(recipe=MXFP8, keep_last=1)
        >>> layers = [Layer(path=p, kind="Dense", role=GEMM) for p in ("blocks/0", "blocks/1")]
        >>> print(conv.plan(layers + [Layer(path="head", kind="Dense", role=GEMM)]))
        blocks/0  Dense  MXFP8           converted
        blocks/1  Dense  high precision  kept: one of the last 1 blocks of 'blocks/'
        head      Dense  high precision  excluded by default: 'head'
        >>> print(Conversion(recipe={"blocks/0": MXFP8, "*": None}).plan(layers))
        blocks/0  Dense  MXFP8           converted: recipe pattern 'blocks/0'
        blocks/1  Dense  high precision  converted: recipe pattern '*'
    """

    # the recipe of the converted layers, or (pattern, recipe) pairs (given as a mapping)
    recipe: Recipe | tuple[tuple[str, Recipe | None], ...] | None
    include: Rule = None  # None: every layer; else the candidates
    exclude: Rule = ()  # never converted, besides the defaults (None: as ())
    exclude_defaults: bool = True  # apply DEFAULT_EXCLUDE and the output-head rule
    attention: bool = False  # also convert the attention products of attention layers
    keep: Rule = None  # converted layers that get keep_recipe
    keep_last: int = 0  # final numbered blocks of each stack that get keep_recipe
    keep_recipe: Recipe | None = None  # the recipe of the kept layers
    caller: str = "quantize_model"  # the function its errors and warnings name

    def __post_init__(self):
        object.__setattr__(self, "recipe", _recipes(self.recipe, self.caller))
        check_recipe(self.keep_recipe, self.caller, name="keep_recipe", optional=True)
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(
                f"{self.caller}: keep_last must be an integer >= 0 (the number of final blocks "
                f"to keep), got {self.keep_last!r}"
            )
        for name in ("exclude_defaults", "attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{self.caller}: {name} must be a bool, got {getattr(self, name)!r}"
                )
        for name in ("include", "exclude", "keep"):
            object.__setattr__(self, name, _normalized(getattr(self, name), name, self.caller))
        if self.exclude is None:
            object.__setattr__(self, "exclude", ())

    def plan(self, layers: Sequence[Layer], *, in_call_order: bool = True) -> ConversionReport:
        """The report of this conversion on a model made of ``layers`` (``in_call_order``: as
        the model calls them, else in an order that says nothing of the model's data flow).

        Raises:
            ValueError: an ``include`` pattern matches no candidate layer, a ``keep`` pattern no
                converted one (every such pattern is named), or ``keep_last`` cannot hold.

        Warns:
            UserWarning: an ``exclude`` pattern matches no candidate layer, or ``attention=True``
                and the model has no attention layer the converter can convert.
        """
        roles = (GEMM, EXPERTS, ATTENTION) if self.attention else (GEMM, EXPERTS)
        candidates = [layer for layer in layers if layer.role in roles]
        self._check_options(layers, candidates)
        head = _head(layers, in_call_order)
        decided = {layer.path: self._decide(layer, head) for layer in candidates}
        converted = [path for path, reason in decided.items() if reason is None]
        self._check_matches(self.keep, converted, "keep", "converted layer", raises=True)
        self._check_recipe_patterns(converted)
        blocks = last_blocks(converted, self.keep_last)
        return ConversionReport(
            self._plan_of(layer, decided.get(layer.path, _NOT_A_CANDIDATE), blocks)
            for layer in layers
        )

    def _check_recipe_patterns(self, converted: list[str]) -> None:
        """With a per-layer mapping: every pattern matches a converted layer, and every
        converted layer a pattern (both raise, naming them)."""
        if not isinstance(self.recipe, tuple):
            return
        patterns = [p for p, _ in self.recipe]
        self._check_matches(patterns, converted, "recipe", "converted layer", raises=True)
        unmatched = [path for path in converted if matching(path, patterns) is None]
        if unmatched:
            raise ValueError(
                f"{self.caller}: converted layer(s) {unmatched} match no pattern of the recipe "
                f"mapping {patterns}; add them, a '*' entry for the others, or exclude them"
            )

    def _check_options(self, layers: Sequence[Layer], candidates: Sequence[Layer]) -> None:
        paths = [layer.path for layer in candidates]
        self._check_matches(self.include, paths, "include", "convertible layer", raises=True)
        self._check_matches(self.exclude, paths, "exclude", "convertible layer", raises=False)
        if self.attention and not any(layer.role == ATTENTION for layer in layers):
            warnings.warn(
                f"{self.caller}: attention=True, but the model has no Flax attention layer "
                "(linen MultiHeadDotProductAttention / nnx MultiHeadAttention) whose products "
                "jaxmx can convert; attention computed by other code (e.g. jnp.einsum) stays in "
                "high precision",
                stacklevel=4,
            )

    def _check_matches(self, rule, paths: list[str], name: str, what: str, *, raises: bool):
        if rule is None or callable(rule):
            return
        missing = [p for p in rule if not any(matching(path, (p,)) for path in paths)]
        if not missing:
            return
        message = (
            f"{self.caller}: {name} pattern(s) {missing} match no {what}; the {what}s are "
            f"{sorted(paths)}"
        )
        if raises:
            raise ValueError(message)
        warnings.warn(message, stacklevel=5)

    def _decide(self, layer: Layer, head: str | None) -> str | None:
        """``None`` if the layer is converted, else why not."""
        if callable(self.exclude):
            if self.exclude(layer.path, layer.module):
                return "excluded: exclude predicate"
        elif (pat := matching(layer.path, self.exclude)) is not None:
            return f"excluded: exclude pattern {pat!r}"
        named = False
        if callable(self.include):
            if not self.include(layer.path, layer.module):
                return "not matched by include"
        elif self.include is not None:
            pat = matching(layer.path, self.include)
            if pat is None:
                return "not matched by include"
            named = any(_is_literal(p) and matching(layer.path, (p,)) for p in self.include)
        if self.exclude_defaults and not named:
            if (pat := matching(layer.path, DEFAULT_EXCLUDE)) is not None:
                return f"excluded by default: {pat!r}"
            if layer.path == head:
                return (
                    "excluded by default: output head (the last projection; its width is the "
                    "size of an embedding table)"
                )
        return None

    def _plan_of(self, layer: Layer, reason: str | None, blocks: frozenset) -> LayerPlan:
        plan = functools.partial(LayerPlan, path=layer.path, kind=layer.kind, layer=layer.module)
        if reason is _NOT_A_CANDIDATE:
            reason = layer.note if layer.role == REFUSED else _NOT_CONVERTED[layer.role]
            return plan(recipe=layer.recipe, converted=False, reason=reason)
        if reason is not None:
            return plan(recipe=None, converted=False, reason=reason)
        kept = self._kept(layer, blocks)
        if kept is not None:
            return plan(recipe=self.keep_recipe, converted=True, reason=kept)
        if isinstance(self.recipe, tuple):
            pat = matching(layer.path, [p for p, _ in self.recipe])
            recipe = dict(self.recipe)[pat]
            return plan(recipe=recipe, converted=True, reason=f"converted: recipe pattern {pat!r}")
        return plan(recipe=self.recipe, converted=True, reason="converted")

    def _kept(self, layer: Layer, blocks: frozenset) -> str | None:
        """Why a converted layer gets ``keep_recipe``, or ``None``."""
        if callable(self.keep):
            if self.keep(layer.path, layer.module):
                return "kept: keep predicate"
        elif self.keep is not None and (pat := matching(layer.path, self.keep)) is not None:
            return f"kept: keep pattern {pat!r}"
        block = block_of(layer.path)
        if block in blocks:
            return f"kept: one of the last {self.keep_last} blocks of {block[0]!r}"
        return None


def _recipes(recipe, caller: str):
    """``recipe`` checked: a Recipe, ``None``, or a mapping ``{pattern: Recipe or None}`` as a
    tuple of pairs (a TypeError / ValueError otherwise)."""
    if isinstance(recipe, Mapping):
        recipe = tuple(recipe.items())
    if not isinstance(recipe, tuple):
        return check_recipe(recipe, caller, optional=True)
    if not recipe:
        raise ValueError(f"{caller}: the recipe mapping is empty; give {{pattern: Recipe}}")
    for pattern, value in recipe:
        if not isinstance(pattern, str):
            raise TypeError(f"{caller}: recipe mapping keys must be path patterns, got {pattern!r}")
        check_recipe(value, caller, name=f"recipe[{pattern!r}]", optional=True)
    return recipe


def dot_general_cls_refusal(path: str) -> ValueError:
    """The error for a matched layer that sets ``dot_general_cls``, which Flax calls instead of
    the ``dot_general`` a converter sets."""
    return ValueError(
        f"quantize_model: layer {path!r} sets dot_general_cls, which Flax calls instead of its "
        "dot_general; exclude the layer or drop its dot_general_cls"
    )


_NOT_A_CANDIDATE = "not a candidate"
_NOT_CONVERTED = {
    ATTENTION: "attention products in high precision (attention=False)",
    EMBEDDING: "embedding table: high precision (never converted)",
    OWN: "jaxmx layer: keeps its own recipe",
}


def _head(layers: Sequence[Layer], in_call_order: bool) -> str | None:
    """The path of the output head by position: the last GEMM layer (``in_call_order``) or else
    the only one, if its output width is the size of one of the model's embedding tables."""
    vocab = {layer.vocab for layer in layers if layer.role == EMBEDDING}
    gemms = [layer for layer in layers if layer.role == GEMM]
    if not in_call_order:
        gemms = [layer for layer in gemms if layer.out_width in vocab]
        return gemms[0].path if len(gemms) == 1 else None
    if gemms and gemms[-1].out_width is not None and gemms[-1].out_width in vocab:
        return gemms[-1].path
    return None
