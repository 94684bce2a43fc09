"""Dense layer y = x @ w.T, jitted forward + backward: jaxmx vs plain lax.dot_general.

Prints, per size, the median step time of jaxmx (each requested backend, with ``--recipe``, a
preset of jaxmx.recipes) as a ratio to the same layer with ``lax.dot_general`` in bfloat16 and in
float32 and to the first backend, all measured in this run (medians of interleaved repeats: one
call of each variant per round), and each step's minor page faults (see benchmarks/timing.py;
``--malloc pooled`` keeps freed memory in the process).

    python benchmarks/dense.py --sizes 1024 2048 --backends emulate xla
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from jax import lax
from timing import MALLOC_CHOICES, interleaved_medians, malloc_setting, use_malloc

import jaxmx

TN = (((1,), (1,)), ((), ()))


def layer_step(dot_general, dtype):
    """A jitted forward + backward of y = x @ w.T: returns y and, for the output cotangent
    ``ct``, dx and dw (three GEMMs)."""

    def step(x, w, ct):
        def layer(x, w):
            return dot_general(x, w, TN, preferred_element_type=jnp.float32)

        y, backward = jax.vjp(layer, x.astype(dtype), w.astype(dtype))
        return y, *backward(ct)

    return jax.jit(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--backends", nargs="+", default=["emulate"], choices=jaxmx.BACKENDS)
    parser.add_argument("--recipe", default="MXFP8", help="a preset of jaxmx.recipes")
    parser.add_argument("--dtype", default="bfloat16", help="jaxmx input dtype")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--malloc", choices=MALLOC_CHOICES, default="default")
    args = parser.parse_args()
    use_malloc(args.malloc)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} cores); "
        f"medians of {args.repeats} interleaved repeats; malloc {malloc_setting()}; "
        f"load average {os.getloadavg()[0]:.1f}; recipe {args.recipe}"
    )
    print(
        f"{'M=N=K':>6} {'f32 ms':>9} {'bf16 ms':>9}  "
        + "  ".join(
            f"{b + ' ms':>12} {'/f32':>6} {'/bf16':>6} {'/' + args.backends[0]:>8}"
            for b in args.backends
        )
        + "  faults/step (f32, bf16, "
        + ", ".join(args.backends)
        + ")"
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
            recipe = getattr(jaxmx.recipes, args.recipe).replace(backend=backend)

            key = jax.random.key(0) if recipe.grad_rounding == "stochastic" else None

            def mx(lhs, rhs, dims, preferred_element_type=None, recipe=recipe, key=key):
                return jaxmx.dot_general(
                    lhs,
                    rhs,
                    dims,
                    preferred_element_type=preferred_element_type,
                    recipe=recipe,
                    key=key,
                )

            fns[backend] = layer_step(mx, jnp.dtype(args.dtype))
        t = interleaved_medians(fns, (x, w, ct), args.repeats)
        row = f"{n:>6} {t['f32'].seconds * 1e3:>9.1f} {t['bf16'].seconds * 1e3:>9.1f}  "
        for backend in args.backends:
            tb = t[backend].seconds
            row += f"{tb * 1e3:>12.1f} {tb / t['f32'].seconds:>6.2f} "
            row += f"{tb / t['bf16'].seconds:>6.2f} "
            row += f"{tb / t[args.backends[0]].seconds:>8.2f}  "
        row += ", ".join(f"{t[name].faults:.0f}" for name in fns)
        print(row, flush=True)


if __name__ == "__main__":
    main()
