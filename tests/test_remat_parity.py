"""``jax.checkpoint`` policies decide for jaxmx GEMMs as for the stock ``lax.dot_general``.

A bf16 model (two Dense-like GEMMs without batch dimensions, one batched GEMM through einsum),
once with jaxmx MXFP8 GEMMs and once with the stock ops: under every named policy of
``jax.checkpoint_policies`` the residuals the backward pass keeps (dtype, memory space, shape)
are the stock model's. The only difference is by design: where a policy saves a GEMM's operands
for its backward pass, jaxmx saves its 8-bit columnwise copies (``jaxmx.LHS_COLWISE``,
``jaxmx.RHS_COLWISE``) instead of the high-precision activations.

The same holds for ``jaxmx.fsdp_dot_general`` inside ``shard_map`` over 8 devices (two GEMMs,
weights sharded on their first dimension), against the stock GEMM of the all-gathered weight:
there the operands the stock model saves include the gathered weights.
"""

import collections
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # in a test only: the residuals' avals
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

import jaxmx

P = jax.checkpoint_policies
EMULATE = jaxmx.recipes.MXFP8.replace(backend="emulate")
DENSE = (((2,), (0,)), ((), ()))  # x [2, 4, 32] . kernel [32, 64] (a Flax Dense)
TN = (((2,), (1,)), ((), ()))  # h [2, 4, 64] . w [48, 64]
NAMES = P.save_only_these_names(jaxmx.LHS_COLWISE, jaxmx.RHS_COLWISE)

POLICIES = {
    "everything_saveable": P.everything_saveable,
    "nothing_saveable": P.nothing_saveable,
    "dots_saveable": P.dots_saveable,
    "checkpoint_dots": P.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "checkpoint_dots_with_no_batch_dims": P.checkpoint_dots_with_no_batch_dims,
    "offload_dot_with_no_batch_dims": P.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "save_only_these_names": P.save_only_these_names("h"),
    "save_any_names_but_these": P.save_any_names_but_these("h"),
    "save_anything_except_these_names": P.save_anything_except_these_names("h"),
    "save_from_both_policies": P.save_from_both_policies(
        P.dots_with_no_batch_dims_saveable, P.save_only_these_names("h")
    ),
    "save_and_offload_only_these_names": P.save_and_offload_only_these_names(
        names_which_can_be_saved=("h",),
        names_which_can_be_offloaded=("z",),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}
# the policies that save the GEMMs' operands: the stock model keeps its high-precision
# activations (h and the batched GEMM's lhs), jaxmx their 8-bit copies instead
SAVES_OPERANDS = {"everything_saveable", "save_anything_except_these_names"}
# the policies that save any named value: jaxmx's 8-bit copies are named ones
SAVES_NAMES = SAVES_OPERANDS | {"save_any_names_but_these"}


def model(dot_general, einsum):
    def loss(params, x):
        kernel, w, wb = params
        h = checkpoint_name(jax.nn.gelu(dot_general(x, kernel, DENSE)), "h")
        y = dot_general(h, w, TN)  # [2, 4, 48]
        z = checkpoint_name(einsum("bsd,bdf->bsf", y, wb), "z")  # batch dimension b
        return jnp.sum(jnp.sin(z).astype(jnp.float32))

    return loss


STOCK = model(jax.lax.dot_general, jnp.einsum)
MX = model(
    functools.partial(jaxmx.dot_general, recipe=EMULATE),
    functools.partial(jaxmx.einsum, recipe=EMULATE),
)
_rng = np.random.default_rng(0)
PARAMS = tuple(
    jnp.asarray(_rng.standard_normal(shape) * 0.1, jnp.bfloat16)
    for shape in ((32, 64), (48, 64), (2, 48, 16))
)
X = jnp.asarray(_rng.standard_normal((2, 4, 32)), jnp.bfloat16)
ACTIVATIONS = collections.Counter({"bf16[2,4,64]": 1, "bf16[2,4,48]": 1})  # the GEMMs' inputs


def residuals(loss, policy) -> list[tuple[str, str]]:
    """(aval with memory space, what it is) of each value the backward pass keeps, arguments
    left out."""
    saved = saved_residuals(jax.checkpoint(loss, policy=policy), PARAMS, X)
    return [
        (aval.str_short(short_dtypes=True), what) for aval, what in saved if "argument" not in what
    ]


TN_2D = (((1,), (1,)), ((), ()))  # x [M, K] . w [N, K]
FSDP_MESH = jax.make_mesh((8,), ("fsdp",))


def fsdp_model(dot):
    """x [64, 32] -> dot(x, w1 [256, 32]) -> gelu, named "h" -> dot(h, w2 [256, 256]), each
    device holding 8 tokens and 32 rows of each weight (``dot(x, w_shard)``)."""

    def loss(x, w1, w2):
        h = checkpoint_name(jax.nn.gelu(dot(x, w1)), "h")
        return jnp.sum(jnp.sin(dot(h, w2)).astype(jnp.float32))

    return loss


def gathered_dot(x, w):
    return jax.lax.dot_general(x, jax.lax.all_gather(w, "fsdp", axis=0, tiled=True), TN_2D)


def fsdp_dot(x, w):
    return jaxmx.fsdp_dot_general(x, w, TN_2D, axis_name="fsdp", gather_axis=0, recipe=EMULATE)


FSDP_ARGS = jax.device_put(
    tuple(
        jnp.asarray(_rng.standard_normal(shape) * 0.1, jnp.bfloat16)
        for shape in ((64, 32), (256, 32), (256, 256))
    ),
    NamedSharding(FSDP_MESH, PartitionSpec("fsdp")),
)


def fsdp_residuals(loss, policy) -> list[tuple[str, str]]:
    """:func:`residuals` of ``loss`` on each device's shards inside ``shard_map``, read while
    the body is traced."""
    found = []

    def body(*args):
        saved = saved_residuals(jax.checkpoint(loss, policy=policy), *args)
        found.extend(
            (aval.str_short(short_dtypes=True), what)
            for aval, what in saved
            if "argument" not in what
        )
        return jax.lax.psum(loss(*args), "fsdp")

    spec = PartitionSpec("fsdp")
    sharded = jax.shard_map(body, mesh=FSDP_MESH, in_specs=spec, out_specs=PartitionSpec())
    jax.jit(sharded).trace(*FSDP_ARGS)
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One op's models, how their residuals are read, the number of 8-bit arrays its copies
    save (codes and scales of two copies per GEMM) and what the stock model saves of the
    GEMMs' operands where a policy saves them."""

    stock: Callable
    mx: Callable
    residuals: Callable
    copies: int
    operands: collections.Counter


V = "{V:fsdp}"  # varying over the shard_map axis
OPS = {
    "dot_general": Case(stock=STOCK, mx=MX, residuals=residuals, copies=12, operands=ACTIVATIONS),
    "fsdp_dot_general": Case(
        stock=fsdp_model(gathered_dot),
        mx=fsdp_model(fsdp_dot),
        residuals=fsdp_residuals,
        copies=8,  # two GEMMs
        operands=collections.Counter(
            {f"bf16[8,256]{V}": 1, f"bf16[256,32]{V}": 1, f"bf16[256,256]{V}": 1}
        ),
    ),
}


def is_copy(what: str) -> bool:
    return jaxmx.LHS_COLWISE in what or jaxmx.RHS_COLWISE in what


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", POLICIES)
def test_every_named_policy_saves_what_it_saves_of_the_stock_model(name, op):
    case = OPS[op]
    stock = case.residuals(case.stock, POLICIES[name])
    got = case.residuals(case.mx, POLICIES[name])
    copies = [aval for aval, what in got if is_copy(what)]
    if name in SAVES_NAMES:
        assert len(copies) == case.copies, got
        assert {a.split("[")[0] for a in copies} == {"u8"}, got  # codes and scales as bits
    else:
        assert copies == [], got
    want = collections.Counter(aval for aval, _ in stock)
    if name in SAVES_OPERANDS:
        assert case.operands <= want, stock
        want -= case.operands
    assert collections.Counter(aval for aval, what in got if not is_copy(what)) == want, (
        got,
        stock,
    )


def test_the_dot_policies_save_the_gemm_outputs_in_the_model_dtype():
    """The stock model's bf16 GEMM outputs: no float32 product, no spurious batch dimension."""
    no_batch = residuals(MX, P.dots_with_no_batch_dims_saveable)
    assert sorted(a for a, _ in no_batch) == ["bf16[2,4,48]", "bf16[2,4,64]"], no_batch
    dots = residuals(MX, P.dots_saveable)
    assert sorted(a for a, _ in dots) == ["bf16[2,4,16]", "bf16[2,4,48]", "bf16[2,4,64]"], dots


def test_offloaded_gemm_outputs_leave_the_gradients_unchanged():
    """The GEMM outputs go to host memory (this runs on the CPU too) and come back as they were."""
    policy = POLICIES["offload_dot_with_no_batch_dims"]
    saved = sorted(aval for aval, _ in residuals(MX, policy))
    assert saved == ["bf16<host>[2,4,48]", "bf16<host>[2,4,64]"], saved
    both = jax.jit(lambda *a: (jax.grad(jax.checkpoint(MX, policy=policy))(*a), jax.grad(MX)(*a)))
    got, want = both(PARAMS, X)  # one compilation
    jax.tree.map(np.testing.assert_array_equal, got, want)
    stock = jax.grad(STOCK)(PARAMS, X)  # an independent check: near the bf16 gradients
    for g, s in zip(got, stock, strict=True):
        g, s = np.asarray(g, np.float32), np.asarray(s, np.float32)
        np.testing.assert_allclose(g, s, atol=0.1 * np.abs(s).max())


@pytest.mark.parametrize(
    "recipe",
    [
        jaxmx.recipes.MXFP8,  # the dispatcher's choice of kernels
        jaxmx.recipes.MXFP8_2D,  # the weight in 32x32 tiles
        EMULATE.replace(residuals="high_precision"),
    ],
    ids=["auto", "weight_tile", "high_precision"],
)
@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_the_dot_policies_decide_alike_under_every_recipe(recipe, name):
    mx = model(
        functools.partial(jaxmx.dot_general, recipe=recipe),
        functools.partial(jaxmx.einsum, recipe=recipe),
    )
    got = sorted(aval for aval, _ in residuals(mx, POLICIES[name]))
    assert got == sorted(aval for aval, _ in residuals(STOCK, POLICIES[name]))
