"""Dense layer y = x @ w.T, jitted forward + backward: jaxmx vs plain lax.dot_general.

Prints, per size, the median step time of jaxmx (each requested backend) as a ratio to the same
layer with ``lax.dot_general`` in bfloat16 and in float32, all measured in this run (medians of
interleaved repeats: one call of each variant per round).

    python benchmarks/dense.py --sizes 1024 2048 --backends emulate
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import jaxmx

TN = (((1,), (1,)), ((), ()))


def layer_step(dot_general, dtype):
    """A jitted forward + backward of y = x @ w.T, returning dx and dw."""

    def loss(x, w, ct):
        y = dot_general(x, w, TN, preferred_element_type=jnp.float32)
        return jnp.vdot(y, ct)

    grad = jax.grad(loss, argnums=(0, 1))
    return jax.jit(lambda x, w, ct: grad(x.astype(dtype), w.astype(dtype), ct))


def median_seconds(fns: dict, args, repeats: int) -> dict:
    """Median seconds per function over ``repeats`` rounds of one call each (interleaved, so that
    drift in the machine's load hits all of them alike), after a compiling warm-up call."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--backends", nargs="+", default=["emulate"])
    parser.add_argument("--dtype", default="bfloat16", help="jaxmx input dtype")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        f"{'M=N=K':>6} {'f32 ms':>9} {'bf16 ms':>9}  "
        + "  ".join(f"{b + ' ms':>12} {'/f32':>6} {'/bf16':>6}" for b in args.backends)
    )
    for n in args.sizes:
        keys = jax.random.split(jax.random.key(n), 3)
        x = jax.random.normal(keys[0], (n, n), jnp.float32)
        w = jax.random.normal(keys[1], (n, n), jnp.float32) / n**0.5
        ct = jax.random.normal(keys[2], (n, n), jnp.float32)
        fns = {
            "f32": layer_step(lax.dot_general, jnp.float32),
            "bf16": layer_step(lax.dot_general, jnp.bfloat16),
        }
        for backend in args.backends:
            recipe = jaxmx.recipes.MXFP8.replace(backend=backend)

            def mx(lhs, rhs, dims, preferred_element_type=None, recipe=recipe):
                return jaxmx.dot_general(
                    lhs, rhs, dims, preferred_element_type=preferred_element_type, recipe=recipe
                )

            fns[backend] = layer_step(mx, jnp.dtype(args.dtype))
        t = median_seconds(fns, (x, w, ct), args.repeats)
        row = f"{n:>6} {t['f32'] * 1e3:>9.1f} {t['bf16'] * 1e3:>9.1f}  "
        for backend in args.backends:
            tb = t[backend]
            row += f"{tb * 1e3:>12.1f} {tb / t['f32']:>6.2f} {tb / t['bf16']:>6.2f}  "
        print(row, flush=True)


if __name__ == "__main__":
    main()
