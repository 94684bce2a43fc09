"""What each format supports beyond quantize and dequantize: one table of features, which the
refusals read and docs/quantization.md prints (a test checks the printed table against it).

A :class:`Feature` says, for a format, why it lacks the feature (``None``: it has it); the
refusals (``quantize(tile=...)``, ``impl="pallas"``, ``jaxmx.ragged_dot``, ``KVCache``,
``requantize``) put that reason in their messages.

Example:
    >>> from jaxmx._src.core.formats import get_format
    >>> lacks(get_format("mxfp8_e4m3"), "tiles") is None
    True
    >>> lacks(get_format("fp8_e4m3_row"), "tiles")
    'one scale per row'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxmx._src.core.formats import FORMATS, Format


@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """One thing a format may support."""

    # the feature as the docs' table heads it
    title: str
    # what it is, for the docs
    what: str
    # why a format lacks it, or None where it has it
    missing: Callable[[Format], str | None]


def _scales_per_block(f: Format) -> str | None:
    """Tokens, tiles and groups need scales that belong to blocks, not a whole row or tensor."""
    return None if f.span == "block" else f"one scale per {f.span}"


def _pallas(f: Format) -> str | None:
    if f.coding == "words":
        return f"{f.bits}-bit codes in {f.dtype}"
    return _scales_per_block(f)


def _through_a_gemm(missing: Callable[[Format], str | None]) -> Callable[[Format], str | None]:
    """``missing`` for a feature that runs a GEMM, which takes every format but the
    storage-only ones."""
    return lambda f: "a storage-only format" if not f.gemm_operand else missing(f)


def _fsdp(f: Format) -> str | None:
    """A gathered weight's scales must not depend on shards the gather joins."""
    if f.span == "row":
        return "one scale per row (not reduced across shards)"
    if f.has_global_scale:
        return "a tensor scale over the gathered weight"
    return None


def _expert_dispatch(f: Format) -> str | None:
    """The dispatch sends each token's codes as bytes, with the token's own scales."""
    if f.storage_bits != 8:
        return "codes that are not whole bytes"
    if f.has_global_scale:
        return "a tensor scale, which has no per-token form"
    return None


def _block_statistics(f: Format) -> str | None:
    """The per-block statistics read E8M0 block scales, or NVFP4's E4M3 ones."""
    return None if f.has_block_statistics else "float32 scales"


def _scaled_dot(f: Format) -> str | None:
    """``lax.scaled_dot`` takes XLA element types and block scales."""
    if f.is_integer:
        return f"elements with no XLA element type ({f.dtype} codes carry an implicit 2^-{f.mbits})"
    if f.element_dtype is not None:
        return f"elements with no XLA element type ({f.bits}-bit codes held in {f.dtype})"
    return _scales_per_block(f)


def _row_relative_frame(f: Format) -> str | None:
    """The emulation decodes E8M0-scaled rows relative to their largest block: a frame that
    ``Recipe(exact_emulation=True)`` lets the training GEMMs leave where it drops products."""
    return None if f.scale_kind.pow2 else "no E8M0 scales (its emulation keeps no frame)"


def _native(f: Format) -> str | None:
    if f.gemm is None:  # cuBLASLt documents FP8 and FP4 block-scaled operands only
        return "no cuBLASLt GEMM takes it"
    return None


FEATURES = {
    "native": Feature(
        title="native GEMM",
        what="a cuBLASLt GEMM (`backend='ffi'`, or `'auto'` on a GPU that runs it)",
        missing=_native,
    ),
    "xla": Feature(
        title="`backend='xla'`",
        what="XLA's block-scaled dot, `lax.scaled_dot` (pairs of one scale kind and block)",
        missing=_through_a_gemm(_scaled_dot),
    ),
    "tiles": Feature(
        title="2-D tiles",
        what="one scale per 2-D tile: `quantize(tile=...)`, `Recipe.weight_tile`",
        missing=_scales_per_block,
    ),
    "pallas": Feature(
        title="Pallas",
        what="the Pallas quantizer (`impl='pallas'`)",
        missing=_pallas,
    ),
    "grouped": Feature(
        title="grouped GEMM",
        what="`jaxmx.ragged_dot` (each group's weight-gradient blocks its own)",
        missing=_through_a_gemm(_scales_per_block),
    ),
    "kv_cache": Feature(
        title="KV cache",
        what="`jaxmx.KVCache` (tokens written a step at a time)",
        missing=_through_a_gemm(_scales_per_block),  # attention reads it through a GEMM
    ),
    "fsdp": Feature(
        title="FSDP gathers",
        what="8-bit weight gathers: `jaxmx.fsdp_dot_general`",
        missing=_through_a_gemm(_fsdp),
    ),
    "expert_dispatch": Feature(
        title="expert dispatch",
        what="8-bit token dispatch: `jaxmx.expert_parallel_ffn`",
        missing=_through_a_gemm(_expert_dispatch),
    ),
    "block_statistics": Feature(
        title="block statistics",
        what="`jaxmx.diagnostics.block_stats` and the GEMM telemetry",
        missing=_block_statistics,
    ),
    "exact_emulation": Feature(
        title="`exact_emulation`",
        what="`Recipe(exact_emulation=True)`: the training GEMMs' exact path for wide scale spans",
        missing=_through_a_gemm(_row_relative_frame),
    ),
    "requantize": Feature(
        title="requantize",
        what="`jaxmx.requantize` (blocks keep their scales)",
        missing=_scales_per_block,
    ),
}
"""Every feature of the table, by name."""


def lacks(f: Format, feature: str) -> str | None:
    """Why ``f`` lacks ``feature`` (a key of :data:`FEATURES`), or None where it has it."""
    return FEATURES[feature].missing(f)


def supporting(feature: str) -> list[str]:
    """The names of the formats of :data:`~jaxmx._src.core.formats.FORMATS` that have
    ``feature``, sorted."""
    return sorted(name for name, f in FORMATS.items() if lacks(f, feature) is None)


def support_table() -> str:
    """The Markdown table of every format (rows) and feature (columns), as docs/quantization.md
    prints it: ``yes``, or ``no`` and the reason; then what each feature is."""
    head = "| format | " + " | ".join(x.title for x in FEATURES.values()) + " |"
    rule = "|---|" + "---|" * len(FEATURES)
    rows = []
    for name, f in FORMATS.items():
        cells = [lacks(f, feature) for feature in FEATURES]
        rows.append(
            f"| `{name}` | " + " | ".join("yes" if c is None else f"no: {c}" for c in cells) + " |"
        )
    features = [f"- {x.title}: {x.what}." for x in FEATURES.values()]
    return "\n".join([head, rule, *rows, "", *features])
