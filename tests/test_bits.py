"""The integer fp8 codec (core/minifloat_codec.py) against ml_dtypes, exhaustively over codes and
ties; ldexp_rounded against exact products; where against jnp.where; the wire form of 8-bit data
(to_wire / from_wire) bit for bit over every code; nibble packing."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmx
from jaxmx._src.core import bits as _bits
from jaxmx._src.core import exponents as _exponents
from jaxmx._src.core import minifloat_codec as _codec
from jaxmx._src.core import wire as _wire

FORMATS = [  # (dtype, mbits, emin, ieee specials, max)
    (ml_dtypes.float8_e4m3fn, 3, -6, False, 448.0),
    (ml_dtypes.float8_e5m2, 2, -14, True, 57344.0),
]


@pytest.mark.parametrize("dtype, mbits, emin, ieee, top", FORMATS)
def test_decode_every_code(dtype, mbits, emin, ieee, top):
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda c: _codec.decode_fp8(c, mbits, emin, ieee))(codes))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("dtype, mbits, emin, ieee, top", FORMATS)
def test_encode_matches_ml_dtypes_on_grid_points_ties_and_random_values(
    dtype, mbits, emin, ieee, top
):
    grid = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= top)])
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway: round to the even code
    rng = np.random.default_rng(0)
    random = rng.uniform(-top, top, 100_000) * 2.0 ** rng.integers(-30, 1, 100_000)
    values = np.concatenate([grid, ties, random]).astype(np.float32)
    values = np.concatenate([values, np.nextafter(values, np.inf), np.nextafter(values, -np.inf)])
    values = np.clip(values, -top, top).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: _codec.encode_fp8(v, mbits, emin))(values))
    np.testing.assert_array_equal(got, values.astype(dtype).view(np.uint8))
    nan = np.asarray(jax.jit(lambda v: _codec.encode_fp8(v, mbits, emin))(np.float32([np.nan])))
    assert np.isnan(nan.view(dtype).astype(np.float32)).all()


def test_ldexp_rounded_is_the_exact_product_rounded_once():
    """Random normal and subnormal float32 times 2^k, against numpy's float64 product rounded
    once to float32 (numpy keeps subnormals); ties and carries into 2^-126 included."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(4000) * np.ldexp(1.0, rng.integers(-60, 60, 4000))
    sub = rng.integers(1, 2**23, 1000).astype(np.uint32) | (rng.integers(0, 2, 1000) << 31)
    edge = [0.0, -0.0, np.inf, -np.inf, np.nan, 5.0, 3.0, 2.0**24 - 1, 1.5, -2.5]
    x = np.concatenate([normal.astype(np.float32), sub.astype(np.uint32).view(np.float32)])
    x = np.concatenate([x, np.array(edge, np.float32)])
    k = rng.integers(-300, 300, x.size).astype(np.int32)
    k[-5:] = [-151, -150, -149 - 24, -150, -150]  # 1.25, 1.5 (tie up), carry, 0.75, 1.25 units
    with np.errstate(over="ignore"):
        want = (x.astype(np.float64) * np.ldexp(1.0, k)).astype(np.float32)
    got = np.asarray(_exponents.ldexp_rounded(x, k))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_times_pow2_is_the_exact_product_rounded_once():
    """Zeros, normal float32 across the whole range, inf and NaN times 2^k for k in
    [-254, 254], against numpy's float64 product rounded once to float32: normal, subnormal
    (ties, carries into 2^-126) and overflowing results."""
    rng = np.random.default_rng(1)
    normal = rng.standard_normal(20000) * np.ldexp(1.0, rng.integers(-126, 128, 20000))
    edge = [0.0, -0.0, np.inf, -np.inf, np.nan, 5.0, 3.0, 2.0**24 - 1, 1.5, -2.5]
    edge += [np.finfo(np.float32).max, -np.finfo(np.float32).max, 2.0**-126, -(2.0**-126)]
    with np.errstate(over="ignore"):
        x = np.concatenate([normal.astype(np.float32), np.array(edge, np.float32)])
    x = x[~(np.abs(x) < 2.0**-126) | (x == 0)]  # no subnormal x: a dot on XLA:CPU gives none
    k = rng.integers(-254, 255, x.size).astype(np.int32)
    k[-14:] = [-151, -150, -149 - 24, -150, -150, 0, 254, -254, -254, 254, -254, 254, -1, -1]
    with np.errstate(over="ignore", invalid="ignore"):
        want = (x.astype(np.float64) * np.ldexp(1.0, k)).astype(np.float32)
    got = np.asarray(jax.jit(_exponents.times_pow2)(x, k))
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same][:5], k[~same][:5], got[~same][:5], want[~same][:5])


@pytest.mark.parametrize(
    "x, y",
    [
        (128, np.arange(6, dtype=np.int32)),
        (np.nan, np.linspace(-1, 1, 6, dtype=np.float32)),
        (np.arange(6, dtype=np.float32), -np.inf),
        (64, 0),
        (jnp.float32(0), jnp.float32(2.5)),
    ],
)
def test_where_equals_jnp_where_bit_for_bit(x, y):
    c = jnp.arange(6) % 2 == 0
    got, want = _bits.where(c, x, y), jnp.where(c, x, y)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_where_constants_are_not_hoisted_out_of_a_scan():
    """A literal broadcast in jnp.where becomes a residual that lax.scan hoists out of the loop,
    full size; _bits.where's constants are built from the operand and stay in the loop."""

    def hoisted(select):
        def body(h, w):
            return select(h @ w > 0, 1.0, h @ w), None

        def loss(ws, x):
            policy = jax.checkpoint_policies.nothing_saveable
            return lax.scan(jax.checkpoint(body, policy=policy), x, ws)[0].sum()

        eqns = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 16, 16)), jnp.ones((8, 16))).eqns
        before = eqns[: [e.primitive.name for e in eqns].index("scan")]
        return [v.aval.shape for e in before for v in e.outvars if v.aval.shape == (8, 16)]

    assert hoisted(jnp.where)  # the pitfall this guards against
    assert not hoisted(_bits.where)


# (dtype, its bit patterns, the wire dtype): every 8-bit and 4-bit dtype jaxmx stores codes or
# scales in. FP6 codes are held in uint8 (XLA takes no float6 dtype), so uint8 covers them.
WIRE_DTYPES = [
    *((t, 256, np.uint8) for t in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")),
    ("int8", 256, np.uint8),
    ("uint8", 256, np.uint8),
    ("float4_e2m1fn", 16, ml_dtypes.uint4),
]


def every_code(name, count):
    """Every bit pattern of ``name`` as a numpy array of it (ml_dtypes), and the patterns."""
    patterns = np.arange(count, dtype=np.uint8)
    return patterns.view(getattr(ml_dtypes, name, None) or np.dtype(name)), patterns


@pytest.mark.parametrize("name, count, wire", WIRE_DTYPES)
def test_to_wire_sends_the_bits_and_from_wire_restores_them(name, count, wire):
    x, patterns = every_code(name, count)
    sent = jax.jit(_wire.to_wire)(x)
    assert sent.dtype == wire and sent.shape == x.shape
    np.testing.assert_array_equal(np.asarray(sent).astype(np.uint8), patterns)
    back = jax.jit(_wire.from_wire, static_argnums=1)(sent, x.dtype)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), patterns)


PASSTHROUGH = [  # NaN payloads, -0, subnormals, infinities: bits must survive
    np.array([0x7FC00001, 0x80000000, 1, 0xFF800000, 0x3F800000], np.uint32).view(np.float32),
    np.array([0x7FC1, 0x8000, 1, 0xFF80], np.uint16).view(ml_dtypes.bfloat16),
    np.array([-1, 0x7FFFFFFF, 0], np.int32),  # an int32 amax
]


@pytest.mark.parametrize("x", PASSTHROUGH, ids=lambda x: x.dtype.name)
def test_wider_arrays_pass_as_they_are_or_as_their_bytes(x):
    sent = _wire.to_wire(x)
    assert sent.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(sent).view(np.uint8), x.view(np.uint8))
    assert _wire.from_wire(sent, x.dtype) is sent
    as_bytes = jax.jit(functools.partial(_wire.to_wire, all_bytes=True))(x)
    want = x.view(np.uint8).reshape(*x.shape, x.dtype.itemsize)  # little-endian, as XLA's
    np.testing.assert_array_equal(np.asarray(as_bytes), want)
    back = _wire.from_wire(as_bytes, x.dtype)
    assert back.dtype == x.dtype and back.shape == x.shape
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("name, count, wire", WIRE_DTYPES)
def test_an_all_gather_of_the_wire_form_moves_one_u8_byte_per_element(name, count, wire):
    """XLA:CPU widens an 8-bit float all-gather to float32 (FP4: float16); the wire form moves
    bytes (collective_bytes reads the compiled HLO)."""
    mesh = jax.make_mesh((8,), ("x",))
    x = np.resize(every_code(name, count)[0], (8, 32))
    spec = NamedSharding(mesh, P("x"))

    def gathered(a):
        wire = jax.lax.all_gather(_wire.to_wire(a), "x", tiled=True)
        return _wire.from_wire(wire, a.dtype)

    f = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False))
    compiled = f.lower(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec)).compile()
    sent = jaxmx.diagnostics.collective_bytes(compiled).by_dtype("all-gather")
    assert sent == {"u8": x.size}  # the gathered array, one byte per element
    out = f(jax.device_put(x, spec))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), x.view(np.uint8))


def test_nibbles_pack_two_per_byte_low_first():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 16, size=(3, 8), dtype=np.uint8)
    packed = _wire.pack_nibbles(jnp.asarray(values, jnp.uint4))
    want = values[:, 0::2] | (values[:, 1::2] << 4)  # element 2i low, 2i + 1 high
    np.testing.assert_array_equal(np.asarray(packed), want)
    back = _wire.unpack_nibbles(packed)
    assert back.dtype == jnp.uint4
    np.testing.assert_array_equal(np.asarray(back.astype(jnp.uint8)), values)
