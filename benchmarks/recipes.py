"""The granularity ladder on the CPU: each recipe's training-step time (ratio to BF16) and the
bytes its GEMM saves for the backward pass.

- Step time: the transformer stack of benchmarks/cpu_step.py (every projection through
  ``jaxmx.dot_general`` with the recipe, stock attention, unrolled blocks), one jitted step
  (``value_and_grad`` of a squared loss, SGD), all recipes timed side by side (the median of
  interleaved repeats after a compiling warm-up, see benchmarks/timing.py), as a ratio to BF16
  (``lax.dot_general`` on bfloat16 operands). Recipes with stochastic gradient rounding run
  under ``jaxmx.stochastic_rounding`` with a fixed key.
- Residuals: the arrays that the vjp of one ``jaxmx.dot_general`` (an MLP up-projection of
  the stack, ``x [batch * seq_len, d_model] . w [d_model, 4 * d_model]``, bfloat16 operands)
  keeps for its backward pass (the leaves of ``jax.vjp``'s function), in bytes per element of
  the two operands: BF16 keeps both operands (2 bytes), a quantized recipe its codes (one
  byte per FP8 / MXFP6 / MXINT8 element, 4 bits per FP4 element) plus their scales.

    python benchmarks/recipes.py --repeats 9
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from cpu_step import ATTENTION, forward, init_params
from jax import lax
from timing import interleaved_medians

import jaxmx

R = jaxmx.recipes
RECIPES = {
    "bf16": None,
    "mxfp8": R.MXFP8,
    "mxfp8_2d": R.MXFP8_2D,
    "deepseek_fp8": R.DEEPSEEK_FP8,
    "nvfp4": R.NVFP4,
    "fp8_tensorwise": R.FP8_TENSORWISE,
    "fp8_rowwise": R.FP8_ROWWISE,
    "fp8_rowwise_gw_hp": R.FP8_ROWWISE_GW_HP,
    "mxfp6_e2m3": jaxmx.Recipe(fwd="mxfp6_e2m3", grad="mxfp6_e2m3"),
    "mxint8": jaxmx.Recipe(fwd="mxint8", grad="mxint8"),
}
"""The recipes compared; ``None`` is BF16."""

_NT = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N]
_KEY = jax.random.key(0)  # the stochastic-rounding key of the timed steps


def dense(recipe):
    """``(x, w) -> x . w`` in bfloat16 (``recipe=None``) or through ``jaxmx.dot_general``."""
    if recipe is None:
        return lambda x, w: lax.dot_general(x, w, _NT, preferred_element_type=jnp.bfloat16)
    return lambda x, w: jaxmx.dot_general(x, w, _NT, recipe=recipe)


def residual_bytes(recipe, x, w) -> list[tuple[tuple[int, ...], str, int]]:
    """``(shape, dtype, bytes)`` of each array that the vjp of ``dense(recipe)(x, w)`` keeps.

    Example:
        >>> x, w = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
        >>> sum(b for *_, b in residual_bytes(None, x, w)) == 2 * (x.size + w.size)
        True
    """
    with jaxmx.stochastic_rounding(_KEY):
        _, vjp = jax.vjp(dense(recipe), x, w)
    return [(a.shape, str(a.dtype), a.size * _bits(a.dtype) // 8) for a in jax.tree.leaves(vjp)]


def _bits(dtype) -> int:
    """Storage bits of one element: 4 for the 4-bit code types, else the item size."""
    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else 8 * dtype.itemsize


def train_step(recipe, heads: int):
    """Jitted ``(params, x, y) -> (loss, params)`` of the stack under ``recipe``."""
    fwd = functools.partial(
        forward, heads=heads, recipe=recipe, attention=ATTENTION["stock"], scanned=False
    )

    def loss(params, x, y):
        return jnp.mean((fwd(params, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, x, y):
        with jaxmx.stochastic_rounding(_KEY):
            value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.seq_len, args.d_model)
    params = init_params(kp, args.layers, args.d_model)
    x = jax.random.normal(kx, shape, jnp.bfloat16)
    y = jax.random.normal(ky, shape, jnp.float32)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform} ({os.cpu_count()} cores); "
        f"{args.layers} blocks, d_model {args.d_model}, {args.heads} heads, batch {args.batch} x "
        f"{args.seq_len} tokens; medians of {args.repeats} interleaved repeats; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    steps = {name: train_step(recipe, args.heads) for name, recipe in RECIPES.items()}
    t = interleaved_medians(steps, (params, x, y), args.repeats)
    a = jax.random.normal(kx, (args.batch * args.seq_len, args.d_model), jnp.bfloat16)
    b = jax.random.normal(ky, (args.d_model, 4 * args.d_model), jnp.bfloat16)
    print(f"residuals of one GEMM x {a.shape} . w {b.shape}, bytes per operand element")
    for name, recipe in RECIPES.items():
        saved = residual_bytes(recipe, a, b)
        per_element = sum(n for *_, n in saved) / (a.size + b.size)
        arrays = ", ".join(f"{dtype}{list(s)}" for s, dtype, _ in saved)
        ms, ratio = t[name].seconds * 1e3, t[name].seconds / t["bf16"].seconds
        print(
            f"  {name:>18}: step {ms:7.1f} ms {ratio:5.2f}x bf16  residuals "
            f"{per_element:.4f} B/elem  ({arrays})"
        )


if __name__ == "__main__":
    main()
