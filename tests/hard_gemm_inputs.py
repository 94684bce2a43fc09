"""The hard inputs of the backend differential tests, and their float64 reference.

Every case is a pair of MXArrays built from codes and scale bytes directly (no quantizer), so the
hard bits are exactly the table's: NaN and inf in codes and scales, +-0, subnormal results,
float32's maximum, all-zero blocks, blocks far below or above their neighbours, block scales that
compensate across the operands, garbage in the padding of a K that is not a multiple of the
block, K of 1, huge and tiny scales. Cases of one group share a shape and are stacked along a
batch axis: one GEMM (one compile per backend) per format pair and group.

The reference decodes the codes with ml_dtypes and the scales from their bytes, in float64
(exact here: every product has at most 16 significant bits and lies within 2^-330 .. 2^330), and
sums in float64. :func:`check` says whether a backend's float32 result is what the exact sum,
rounded to float32, allows within docs/native.md's differential bound::

    |out - exact| <= (K + 6) * 2^-24 * sum_k |a_k b_k| + 2^-126 * (sum_k |a_k| + sum_k |b_k| + K)

(a float32 sum of K terms and its roundings; the second term: float32 subnormal operands,
products and partial sums, which XLA:CPU flushes). Where the exact result is past float32's
range the result must be the infinity of its sign; where ``sum_k |a_k b_k|`` is, a partial sum
may overflow (documented), so any non-finite result passes; a NaN reference needs a NaN.
Block FP8's dequantized emulation and native GEMM round each element ``code * s`` to float32
first: a row holding an element past float32's range may give a non-finite result there.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import jaxmx
from jaxmx._src.core.formats import get_format

F32_MAX = float(np.finfo(np.float32).max)
NAN_BYTE = 255

# Each group: (rows of lhs, rows of rhs, K); cases of a group are stacked along a batch axis.
MX_GROUPS = {"narrow": (2, 3, 70), "wide": (2, 3, 70), "k1": (2, 3, 1)}
BLOCK_GROUPS = {"block": (2, 3, 256)}


@dataclasses.dataclass(frozen=True)
class Side:
    """One operand of a case: block exponents ``[rows, KB]`` (None: NaN scale) and overrides
    of the random codes: ``values[(row, k)] = v`` (v in element units; ``"nan"``, ``"inf"``,
    ``"-inf"`` where the format has them) and ``zero_blocks`` ``[(row, block)]``."""

    exponents: tuple
    values: tuple = ()
    zero_blocks: tuple = ()
    negate: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str
    lhs: Side
    rhs: Side


def _rows(*rows):
    return tuple(tuple(r) for r in rows)


# Exponents per block (3 blocks of 32 for K = 70: the last one half padding).
MX_CASES = (
    Case("moderate", "narrow", Side(_rows([0, -3, 2], [1, 1, -2])), Side(_rows(*[[2, 0, -1]] * 3))),
    Case(
        "nan_scale",
        "narrow",
        Side(_rows([0, None, 1], [0, 0, 0])),
        Side(_rows([0, 0, 0], [1, 2, 3], [None, 0, 0])),
    ),
    Case(
        "nan_and_inf_codes",
        "narrow",
        Side(_rows([0, 0, 0], [0, 0, 0]), values=(((0, 3), "nan"), ((1, 40), "inf"))),
        Side(_rows([0, 0, 0], [0, 0, 0], [0, 0, 0]), values=(((2, 5), "-inf"),)),
    ),
    Case(
        "signed_zeros",
        "narrow",
        Side(_rows([0, 0, 0], [5, 5, 5]), zero_blocks=((0, 0), (0, 1), (0, 2)), negate=True),
        Side(_rows([0, 0, 0], [0, 0, 0], [0, 0, 0]), zero_blocks=((1, 0), (1, 1), (1, 2))),
    ),
    Case(
        "subnormal_results",
        "narrow",
        Side(_rows([-70, -70, -71], [-75, -72, -74])),
        Side(_rows([-70, -72, -70], [-70, -70, -70], [-66, -66, -66])),
    ),
    Case(
        "float32_max",
        "narrow",
        Side(_rows([127, 127, 126], [120, 121, 119])),
        Side(_rows([-8, -9, -8], [0, 0, 0], [-127, -120, -127])),
    ),
    Case(
        "all_zero_blocks_far_below",
        "narrow",
        Side(_rows([0, -127, 0], [3, -127, -127]), zero_blocks=((0, 1), (1, 1), (1, 2))),
        Side(_rows([0, 0, 0], [-1, -2, -3], [2, 2, 2])),
    ),
    Case(
        "compensating",
        "wide",
        Side(_rows([73, -67, 0], [73, -67, -67])),
        Side(_rows([-67, 73, 0], [-67, 73, -67], [-60, 60, 0])),
    ),
    Case(
        "dominant_block_deep",
        "wide",
        Side(_rows([100, -30, 0], [100, -30, -30])),
        Side(_rows([-127, 105, 0], [-127, 105, -127], [-127, 105, 105]), zero_blocks=((0, 0),)),
    ),
    Case(
        "zero_block_at_the_top",
        "wide",
        Side(_rows([127, -20, -25], [127, 0, 0]), zero_blocks=((0, 0), (1, 0))),
        Side(_rows([0, 0, 0], [-3, 4, 1], [10, -10, 0])),
    ),
    Case(
        "full_range",
        "wide",
        Side(_rows([127, -127, 0], [-127, 127, 64])),
        Side(_rows([-127, 127, 0], [0, -64, -127], [127, 127, -127])),
    ),
    Case(
        "far_below_and_above",
        "wide",
        Side(_rows([0, -100, 100], [50, -50, 0])),
        Side(_rows([-100, 100, -50], [0, -110, 0], [-90, 80, 0])),
    ),
    Case(
        "overflow_of_one_sign",  # block sums past float32's range of both signs, a finite total
        "wide",
        Side(_rows([127, 127, -127], [127, 126, -120])),
        Side(_rows([127, 127, 0], [126, 127, -127], [0, 0, 0])),
    ),
    Case("k1_moderate", "k1", Side(_rows([0], [-5])), Side(_rows([3], [0], [-2]))),
    Case("k1_huge_and_tiny", "k1", Side(_rows([127], [-127])), Side(_rows([-127], [127], [0]))),
    Case("k1_nan_scale", "k1", Side(_rows([None], [0])), Side(_rows([0], [None], [127]))),
)

# Block FP8 (128-blocks): float32 scales given as powers of two (exponents) for the pow2 cases,
# or as float32 values (``scales``) for the float-scale cases.
BLOCK_POW2_CASES = (
    Case("moderate", "block", Side(_rows([0, -3], [1, 2])), Side(_rows([1, 0], [0, 0], [-2, 3]))),
    Case(
        "nan_scale_and_inf_sign",
        "block",
        Side(_rows([None, 0], [0, 0])),
        Side(_rows([0, 0], [127, 127], [0, -3])),
    ),
    Case(
        "huge_times_448",
        "block",
        Side(_rows([127, 0], [127, 127]), values=(((0, 0), 448.0), ((1, 200), -448.0))),
        Side(_rows([-127, 0], [-120, -127], [0, -127])),
    ),
    Case(
        "compensating",
        "block",
        Side(_rows([73, -67], [100, -30])),
        Side(_rows([-67, 73], [-127, 105], [-30, 100])),
    ),
    Case(
        "signed_zeros",
        "block",
        Side(_rows([0, 0], [0, 0]), zero_blocks=((0, 0), (0, 1)), negate=True),
        Side(_rows([0, 0], [0, 0], [0, 0]), zero_blocks=((2, 0), (2, 1))),
    ),
)

BLOCK_FLOAT_SCALES = (  # [case][lhs rows x 2 blocks, rhs rows x 2 blocks]
    ("moderate", [[0.5, 3.0], [1e-3, 7.0]], [[1.5, 0.25], [2.0, 2.0], [1e3, 1e-3]]),
    (
        "huge_and_tiny",
        [[3.0e35, 1.1e-30], [1.0, 2.0e-20]],
        [[1.7e-36, 9.0e29], [4.0e-38, 1.0], [1.0, 1.0]],
    ),
    ("nan_scale", [[float("nan"), 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, float("nan")], [1.0, 1.0]]),
    ("near_float32_max", [[7.0e35, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.5e2, 1.0], [1.0, 1.0]]),
)


# --- building the operands ------------------------------------------------------------------


def element_values(fmt: str) -> np.ndarray:
    """Every finite element value of ``fmt`` (float64)."""
    f = get_format(fmt)
    if f.is_integer:
        return np.arange(-127, 128) * 2.0**-f.mbits
    dtype = np.dtype(f.element_dtype or f.dtype)
    width = {"float4_e2m1fn": 4, "float6_e2m3fn": 6, "float6_e3m2fn": 6}.get(dtype.name, 8)
    values = np.arange(2**width, dtype=np.uint8).view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def encode(values: np.ndarray, fmt: str) -> jnp.ndarray:
    """The codes (MXArray data) of element values ``values`` (float64, exactly on the grid)."""
    f = get_format(fmt)
    if f.is_integer:
        return jnp.asarray(np.round(values * 2.0**f.mbits).astype(np.int8))
    if f.element_dtype is not None:
        codes = values.astype(f.element_dtype).view(np.uint8)
        return jnp.asarray(codes)
    return jnp.asarray(values.astype(f.dtype))


def _special(v, fmt: str) -> float | None:
    """An override's value, or None where the format has no such code (NaN: FP8 only; inf:
    E5M2 only)."""
    f = get_format(fmt)
    if v == "nan":
        return np.nan if np.dtype(f.dtype).name.startswith("float8") else None
    if v in ("inf", "-inf"):
        return float(v) if f.has_inf else None
    return float(v)


def side_values(side: Side, fmt: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Element values ``[rows, padded K]`` of a side: random (a fixed seed), then the
    overrides; the padding holds the format's largest value (the GEMMs must ignore it)."""
    f = get_format(fmt)
    padded = -(-k // f.block) * f.block
    rng = np.random.default_rng(seed)
    grid = element_values(fmt)
    values = rng.choice(grid, size=(rows, padded))
    if side.negate:
        values = -np.abs(values)
    for r, b in side.zero_blocks:
        values[r, b * f.block : (b + 1) * f.block] = -0.0 if side.negate else 0.0
    for (r, c), v in side.values:
        special = _special(v, fmt)
        if special is not None:
            values[r, c] = special
    values[:, k:] = f.elem_max
    return values


def mx_operand(side: Side, fmt: str, rows: int, k: int, seed: int):
    """(MXArray [rows, k], float64 decoded values [rows, k])."""
    f = get_format(fmt)
    values = side_values(side, fmt, rows, k, seed)
    byte = np.array(
        [[NAN_BYTE if e is None else e + 127 for e in row] for row in side.exponents], np.uint8
    )
    scale = np.where(byte == NAN_BYTE, np.nan, 2.0 ** (byte.astype(np.float64) - 127))
    decoded = values * np.repeat(scale, f.block, axis=1)
    q = jaxmx.MXArray(
        encode(values, fmt), jnp.asarray(byte).view(jnp.float8_e8m0fnu), fmt, 1, (rows, k)
    )
    return q, decoded[:, :k]


def block_operand(side_or_scales, fmt: str, rows: int, k: int, seed: int):
    """Block FP8: (MXArray [rows, k] with float32 scales, float64 decoded values)."""
    f = get_format(fmt)
    if isinstance(side_or_scales, Side):
        side = side_or_scales
        scale = np.array(
            [[np.nan if e is None else 2.0**e for e in row] for row in side.exponents], np.float64
        )
    else:
        side, scale = Side(()), np.array(side_or_scales, np.float64)
    values = side_values(side, fmt, rows, k, seed)
    scale32 = scale.astype(np.float32)
    decoded = values * np.repeat(scale32.astype(np.float64), f.block, axis=1)
    q = jaxmx.MXArray(encode(values, fmt), jnp.asarray(scale32), fmt, 1, (rows, k))
    return q, decoded[:, :k]


def decode(q) -> np.ndarray:
    """float64 values ``[rows, K]`` of a block-FP8 MXArray (1-D blocks or tiles) along its last
    axis, from its codes and float32 scales."""
    f = get_format(q.fmt)
    codes = np.asarray(q.data).astype(np.float64)
    scale = np.asarray(q.scale).astype(np.float64)
    if q.tile is not None:
        scale = np.repeat(scale, q.tile[0], axis=-2)[: codes.shape[-2]]
    with np.errstate(invalid="ignore"):
        values = codes * np.repeat(scale, f.block, axis=-1)
    return values[: q.shape[-2], : q.shape[-1]]


def stacked(pairs):
    """One batched pair of MXArrays (and float64 operands) from per-case pairs of one shape."""

    def stack(qs):
        data = jnp.stack([q.data for q in qs])
        scale = jnp.stack([q.scale for q in qs])
        return jaxmx.MXArray(data, scale, qs[0].fmt, 2, (len(qs), *qs[0].shape))

    a = stack([p[0] for p in pairs])
    b = stack([p[1] for p in pairs])
    x = np.stack([p[2] for p in pairs])
    y = np.stack([p[3] for p in pairs])
    return a, b, x, y


def mx_group(fmts: tuple[str, str], group: str):
    """(names, lhs, rhs, x, y) of the MX cases of ``group`` in formats ``fmts``."""
    m, n, k = MX_GROUPS[group]
    cases = [c for c in MX_CASES if c.group == group]
    pairs = []
    for i, c in enumerate(cases):
        a, x = mx_operand(c.lhs, fmts[0], m, k, seed=2 * i)
        b, y = mx_operand(c.rhs, fmts[1], n, k, seed=2 * i + 1)
        pairs.append((a, b, x, y))
    return ([c.name for c in cases], *stacked(pairs))


def block_group(fmts: tuple[str, str], pow2: bool):
    """(names, lhs, rhs, x, y) of the block-FP8 cases: power-of-two or float32 scales."""
    m, n, k = BLOCK_GROUPS["block"]
    pairs, names = [], []
    if pow2:
        for i, c in enumerate(BLOCK_POW2_CASES):
            a, x = block_operand(c.lhs, fmts[0], m, k, seed=2 * i)
            b, y = block_operand(c.rhs, fmts[1], n, k, seed=2 * i + 1)
            pairs.append((a, b, x, y))
            names.append(c.name)
    else:
        for i, (name, sa, sb) in enumerate(BLOCK_FLOAT_SCALES):
            a, x = block_operand(sa, fmts[0], m, k, seed=2 * i)
            b, y = block_operand(sb, fmts[1], n, k, seed=2 * i + 1)
            pairs.append((a, b, x, y))
            names.append(name)
    return (names, *stacked(pairs))


# --- the reference and the check ---------------------------------------------------------------


def reference(x: np.ndarray, y: np.ndarray, relative: float | None = None):
    """(exact float64 GEMM, sum |products|, the bound) of decoded operands [..., rows, K];
    ``relative``: the bound's factor of ``sum |products|`` (default ``(K + 6) * 2^-24``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        exact = np.einsum("...mk,...nk->...mn", x, y)
        abs_sum = np.einsum("...mk,...nk->...mn", np.abs(x), np.abs(y))
    k = x.shape[-1]
    with np.errstate(invalid="ignore"):
        a_sum = np.nansum(np.abs(x), axis=-1)[..., :, None]
        b_sum = np.nansum(np.abs(y), axis=-1)[..., None, :]
    relative = (k + 6) * 2.0**-24 if relative is None else relative
    bound = relative * abs_sum + 2.0**-126 * (a_sum + b_sum + k)
    return exact, abs_sum, bound


def problems(
    out, x, y, names, decodes_to_float32=False, relative=None, partial_overflow=True
) -> list[str]:
    """Each entry of ``out`` [cases, M, N] (float32) that the reference does not allow, named.
    ``decodes_to_float32``: the backend rounds each decoded element ``code * s`` to float32
    (block FP8's dequantized emulation and native GEMM), so a row holding an element past
    float32's range may give a non-finite result (documented). ``relative``: as
    :func:`reference`'s (cuBLASLt: ``2^-12``). ``partial_overflow``: the backend sums in a fixed
    frame, so where ``sum |products|`` is past float32's range a partial sum may overflow (any
    non-finite result is then allowed); without it such an entry is held to the exact result
    (the infinity of its sign where that overflows)."""
    out = np.asarray(out, np.float64)
    exact, abs_sum, bound = reference(x, y, relative)
    with np.errstate(invalid="ignore"):
        over_a = (np.abs(x) > F32_MAX).any(axis=-1)[..., :, None]
        over_b = (np.abs(y) > F32_MAX).any(axis=-1)[..., None, :]
    beyond = (over_a | over_b) & decodes_to_float32
    bad = []
    for index in np.ndindex(out.shape):
        got, want, slack = out[index], exact[index], bound[index]
        if beyond[index] and not np.isfinite(got):
            continue
        if np.isnan(want):
            ok = np.isnan(got)
        elif np.isinf(want):
            ok = got == want
        elif partial_overflow and abs_sum[index] > F32_MAX:
            ok = not np.isfinite(got) or abs(got - want) <= slack
        elif abs(want) - slack > F32_MAX * (1 + 2.0**-25):
            ok = got == np.sign(want) * np.inf
        elif abs(want) + slack < F32_MAX:
            ok = np.isfinite(got) and abs(got - want) <= slack
        else:
            ok = got == np.sign(want) * np.inf or abs(got - want) <= slack
        if not ok:
            bad.append(f"{names[index[0]]}{list(index[1:])}: got {got!r}, exact {want!r}")
    return bad


def same_bits(out, emulated) -> np.ndarray:
    """Where two float32 results are equal bit for bit (any NaN equals any NaN)."""
    u, v = np.asarray(out, np.float32), np.asarray(emulated, np.float32)
    return (u.view(np.uint32) == v.view(np.uint32)) | (np.isnan(u) & np.isnan(v))


def ulp_distance(out, emulated) -> np.ndarray:
    """|out - emulated| in float32 ulps of the emulated value (0 where the bits agree)."""
    u, v = np.asarray(out, np.float32), np.asarray(emulated, np.float32)
    spacing = np.spacing(np.abs(v)).astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(u.astype(np.float64) - v.astype(np.float64)) / spacing
    return np.where(same_bits(u, v), 0.0, d)
