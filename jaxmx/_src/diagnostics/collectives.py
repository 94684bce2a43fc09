"""What a compiled SPMD program sends between devices: the collectives' bytes by kind and dtype.

:func:`collective_bytes` reads the optimized HLO of a compiled program (``jit(f).lower(...)
.compile()``, or its ``as_text()``) and adds up, for each collective instruction, the size of
its result: the gathered array of an ``all-gather``, the summed array of an ``all-reduce``, the
scattered shard of a ``reduce-scatter``, the exchanged array of an ``all-to-all`` (and of
``ragged-all-to-all`` and ``collective-permute``). Sizes are per device, as the HLO states them
after SPMD partitioning. An asynchronous pair (``all-gather-start`` / ``-done``) is counted once,
at its start; a start's result tuple holds its operands as well as its results, and only the
results are counted.

The dtype is the one on the wire: XLA:CPU widens bfloat16 collectives to float32 and 8-bit
float ones to 16 or 32 bits, which is why jaxmx sends its 8-bit codes and scales as ``uint8``.

Example:
    >>> text = '''
    ...   %ag = u8[1024,1024]{1,0} all-gather(u8[128,1024]{1,0} %p), dimensions={0}
    ...   %ar = f32[16]{0} all-reduce(f32[16]{0} %q), to_apply=%add
    ... '''
    >>> b = collective_bytes(text)
    >>> b.of("all-gather"), b.of("all-gather", "u8"), b.of("all-reduce", "f32")
    (1048576, 1048576, 64)
    >>> b.by_dtype("all-gather")
    {'u8': 1048576}
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
"""The collective kinds :func:`collective_bytes` counts."""

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "f4e2m1fn": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e8m0fnu": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_KINDS = "|".join(re.escape(k) for k in sorted(COLLECTIVES, key=len, reverse=True))
# "%name = <result type> <kind>[-start](" ; the result type is a shape or a tuple of shapes.
_INSTRUCTION = re.compile(rf"=\s*(?P<type>.+?)\s+(?P<kind>{_KINDS})(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


# an HLO instruction: "[ROOT] [%]name = <dtype>[dims] ..." or "... = (tuple) ..."
_HLO_LINE = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*(\(|[a-z][a-z0-9]*\[)", re.MULTILINE)
_MLIR = ("stablehlo.", "mhlo.", "func.func")


def _check_hlo(text: str) -> None:
    """A ValueError unless ``text`` reads as HLO (an ``HloModule`` or HLO instructions)."""
    if any(marker in text for marker in _MLIR):
        raise ValueError(
            "collective_bytes: the text is StableHLO / MLIR (a Lowered program's), not the "
            "optimized HLO; pass jax.jit(f).lower(...).compile() or its as_text()"
        )
    if "HloModule" not in text and _HLO_LINE.search(text) is None:
        raise ValueError(
            f"collective_bytes: the text is not HLO (no HloModule and no HLO instruction): "
            f"{text[:80]!r}"
        )


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """Bytes moved per device by one compiled program, by collective kind and dtype.

    Attributes:
        bytes: ``{(kind, dtype): bytes}``, e.g. ``{("all-gather", "u8"): 8650752}``.
        count: ``{kind: number of instructions}``.
    """

    bytes: dict[tuple[str, str], int]
    count: dict[str, int]

    def of(self, kind: str, dtype: str | None = None) -> int:
        """The bytes of collective ``kind`` (one of :data:`COLLECTIVES`), of ``dtype`` only when
        given (an HLO dtype name: ``"u8"``, ``"bf16"``, ``"f32"``, ...)."""
        if kind not in COLLECTIVES:
            raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
        return sum(n for (k, d), n in self.bytes.items() if k == kind and dtype in (None, d))

    def by_dtype(self, kind: str) -> dict[str, int]:
        """``{dtype: bytes}`` of collective ``kind``."""
        self.of(kind)  # checks the kind
        return {d: n for (k, d), n in sorted(self.bytes.items()) if k == kind}


def collective_bytes(compiled) -> CollectiveBytes:
    """The collectives of a compiled program (or of its HLO text), by kind and dtype.

    Args:
        compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``) or the text
            of an HLO module after SPMD partitioning (``compiled.as_text()``).

    Returns:
        A :class:`CollectiveBytes`.

    Raises:
        TypeError: a ``jax.stages.Lowered`` (not yet partitioned: compile it) or another object.
        ValueError: text that is not HLO (StableHLO included), an unknown HLO dtype.
    """
    if isinstance(compiled, jax.stages.Lowered):
        raise TypeError(
            "collective_bytes: got a jax.stages.Lowered, whose text is StableHLO before SPMD "
            "partitioning (no collectives yet); pass lowered.compile()"
        )
    as_text = getattr(compiled, "as_text", None)
    text = compiled if isinstance(compiled, str) else as_text() if callable(as_text) else None
    if not isinstance(text, str):
        raise TypeError(
            f"collective_bytes: expected a compiled program or its HLO text, got {type(compiled)}"
        )
    _check_hlo(text)
    moved: dict[tuple[str, str], float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for line in text.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        kind = match["kind"]
        shapes = _SHAPE.findall(match["type"])
        if match["start"] and len(shapes) > 1:  # (operands..., results...): the results
            shapes = shapes[len(shapes) // 2 :]
        count[kind] += 1
        for dtype, dims in shapes:
            if dtype not in _DTYPE_BYTES:
                raise ValueError(f"collective_bytes: unknown HLO dtype {dtype!r}: {line.strip()}")
            size = math.prod(int(d) for d in dims.split(",") if d)
            moved[(kind, dtype)] += size * _DTYPE_BYTES[dtype]
    return CollectiveBytes(
        bytes={k: math.ceil(v) for k, v in sorted(moved.items())}, count=dict(count)
    )
