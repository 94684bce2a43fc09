"""CPU training-step time of a small transformer: MX attention, and scanned MXFP8 stacks.

A stack of pre-norm transformer blocks (QKV and output projections, causal attention, a GELU
MLP; float32 parameters, bfloat16 activations) in plain JAX, one jitted step: ``value_and_grad``
of a squared loss, then an SGD update of the parameters. Two groups of variants, each timed
side by side (the median of interleaved repeats after a compiling warm-up, see
benchmarks/timing.py) and printed as a ratio to its group's baseline:

- ``attention``: the projections through ``jaxmx.dot_general`` (MXFP8) in every variant;
  attention by ``jax.nn.dot_product_attention`` (the baseline), by
  ``jaxmx.dot_product_attention(recipe=None)`` (jaxmx's layout, plain products) and by
  ``jaxmx.dot_product_attention`` (MXFP8 products).
- ``scan``: the blocks under ``lax.scan`` (stacked parameters, no remat) and unrolled, stock
  bfloat16 (``lax.dot_general``, the baseline: scanned) against MXFP8 (``jaxmx.dot_general``).

``--breakdown`` also times the forward pass alone and the attention function alone (forward and
forward + backward), passes over one logits-sized tensor (the softmax, and the MXFP8
quantizations MX attention adds), and the compiled steps' XLA cost analysis.

    python benchmarks/cpu_step.py --repeats 9
    python benchmarks/cpu_step.py --repeats 9 --breakdown
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from timing import MALLOC_CHOICES, interleaved_medians, malloc_setting, use_malloc

import jaxmx
from jaxmx._src.quantize.fake import quantize_to_grid

_NT = (((2,), (0,)), ((), ()))  # x [B, T, D] . kernel [D, F]


def init_params(key, layers: int, d: int) -> dict:
    """Stacked block parameters (leading axis: the layer), float32."""
    shapes = {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
    keys = jax.random.split(key, len(shapes))
    return {
        name: jax.random.normal(k, (layers, *shape), jnp.float32) * shape[0] ** -0.5
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def block(p: dict, x, *, heads: int, recipe, attention):
    """One pre-norm block on ``x [B, T, D]`` (bfloat16)."""
    b, t, d = x.shape

    def dense(h, kernel):
        kernel = kernel.astype(jnp.bfloat16)
        if recipe is None:
            return lax.dot_general(h, kernel, _NT, preferred_element_type=jnp.bfloat16)
        return jaxmx.dot_general(h, kernel, _NT, recipe=recipe)

    h = _rms_norm(x)
    q, k, v = jnp.split(dense(h, p["qkv"]).reshape(b, t, 3, heads, d // heads), 3, axis=2)
    y = attention(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    x = x + dense(y.reshape(b, t, d), p["out"])
    return x + dense(jax.nn.gelu(dense(_rms_norm(x), p["up"])), p["down"])


def _rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def forward(params, x, *, scanned: bool, **block_args):
    step = functools.partial(block, **block_args)
    if scanned:
        x, _ = lax.scan(lambda h, p: (step(p, h), None), x, params)
        return x
    for i in range(params["qkv"].shape[0]):
        x = step(jax.tree.map(lambda a, i=i: a[i], params), x)
    return x


def train_step(**forward_args):
    """Jitted ``(params, x, y) -> (loss, params)``: value_and_grad, then SGD."""

    def loss(params, x, y):
        out = forward(params, x, **forward_args).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step, jax.jit(loss)


ATTENTION = {
    "stock": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "jaxmx, recipe=None": lambda q, k, v: jaxmx.dot_product_attention(
        q, k, v, is_causal=True, recipe=None
    ),
    "jaxmx mxfp8": lambda q, k, v: jaxmx.dot_product_attention(q, k, v, is_causal=True),
}


def groups(heads: int) -> dict[str, dict[str, dict]]:
    mx = jaxmx.recipes.MXFP8
    common = {"heads": heads}
    attention = {
        f"{name} attention": dict(common, recipe=mx, attention=fn, scanned=False)
        for name, fn in ATTENTION.items()
    }
    stock = ATTENTION["stock"]
    scan = {
        f"{label} {'scanned' if scanned else 'unrolled'}": dict(
            common, recipe=recipe, attention=stock, scanned=scanned
        )
        for scanned in (True, False)
        for label, recipe in (("bf16", None), ("mxfp8", mx))
    }
    return {"attention": attention, "scan": scan}


def attention_alone(q, k, v, repeats: int) -> None:
    """The attention function by itself: forward, and forward + backward (grad of a sum)."""
    fns = {}
    for name, fn in ATTENTION.items():
        fns[f"{name} fwd"] = jax.jit(fn)
        fns[f"{name} fwd+bwd"] = jax.jit(
            jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
        )
    t = interleaved_medians(fns, (q, k, v), repeats)
    print(f"attention alone, q/k/v {q.shape} {q.dtype}:")
    for name in ATTENTION:
        for part in ("fwd", "fwd+bwd"):
            ms = t[f"{name} {part}"].seconds * 1e3
            ratio = t[f"{name} {part}"].seconds / t[f"stock {part}"].seconds
            print(f"  {name + ' ' + part:>28}: {ms:7.2f} ms  {ratio:5.2f}x stock")


def logits_passes(shape, repeats: int) -> None:
    """Passes over one attention's logits-sized tensor ``[B * N, T, S]``: the softmax, and the
    MXFP8 quantizations that MX attention adds (each of P and dP/dlogits along S and along T)."""
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    fns = {
        "softmax (f32)": lambda x: jax.nn.softmax(x, axis=-1),
        "P bf16 along S": lambda x: quantize_to_grid(x.astype(jnp.bfloat16), axis=-1).data,
        "P bf16 along T": lambda x: quantize_to_grid(x.astype(jnp.bfloat16), axis=-2).data,
        "P bf16 codes along T": lambda x: jaxmx.quantize(x.astype(jnp.bfloat16), axis=-2).data,
        "dlogits f32 along S": lambda x: quantize_to_grid(x, axis=-1).data,
        "dlogits f32 along T": lambda x: quantize_to_grid(x, axis=-2).data,
    }
    t = interleaved_medians({n: jax.jit(f) for n, f in fns.items()}, (x,), repeats)
    print(f"one pass over a logits-sized tensor {shape}:")
    for name in fns:
        ms = t[name].seconds * 1e3
        print(
            f"  {name:>28}: {ms:7.3f} ms  {ms / (t['softmax (f32)'].seconds * 1e3):5.2f}x softmax"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--groups", nargs="+", choices=("attention", "scan"))
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--malloc", choices=MALLOC_CHOICES, default="default")
    args = parser.parse_args()
    use_malloc(args.malloc)
    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.seq_len, args.d_model)
    params = init_params(kp, args.layers, args.d_model)
    x = jax.random.normal(kx, shape, jnp.bfloat16)
    y = jax.random.normal(ky, shape, jnp.float32)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform} ({os.cpu_count()} cores); "
        f"{args.layers} blocks, d_model {args.d_model}, {args.heads} heads, batch {args.batch} x "
        f"{args.seq_len} tokens; medians of {args.repeats} interleaved repeats; malloc "
        f"{malloc_setting()}; load average {os.getloadavg()[0]:.1f}"
    )
    for group, variants in groups(args.heads).items():
        if args.groups and group not in args.groups:
            continue
        steps = {name: train_step(**v) for name, v in variants.items()}
        fns = {name: s for name, (s, _) in steps.items()}
        if args.breakdown:
            fns.update({f"{name} fwd": loss for name, (_, loss) in steps.items()})
        t = interleaved_medians(fns, (params, x, y), args.repeats)
        base = next(iter(variants))
        print(f"{group}: ratios to {base!r}")
        for name in variants:
            ms, ratio = t[name].seconds * 1e3, t[name].seconds / t[base].seconds
            line = f"  {name:>26}: step {ms:7.1f} ms  {ratio:5.2f}x"
            if args.breakdown:
                fwd = t[f"{name} fwd"].seconds
                cost = steps[name][0].lower(params, x, y).compile().cost_analysis()
                line += (
                    f"  fwd {fwd * 1e3:6.1f} ms {fwd / t[f'{base} fwd'].seconds:5.2f}x"
                    f"  bwd {(t[name].seconds - fwd) * 1e3:6.1f} ms"
                    f"  {cost.get('flops', 0) / 1e9:5.2f} GFLOP"
                    f"  {cost.get('bytes accessed', 0) / 2**20:6.0f} MiB accessed"
                )
            print(line)
    if args.breakdown:
        heads_shape = (args.batch, args.seq_len, args.heads, args.d_model // args.heads)
        keys = jax.random.split(kx, 3)
        q, k, v = (jax.random.normal(kk, heads_shape, jnp.bfloat16) for kk in keys)
        attention_alone(q, k, v, args.repeats)
        logits_passes((args.batch * args.heads, args.seq_len, args.seq_len), args.repeats)


if __name__ == "__main__":
    main()
