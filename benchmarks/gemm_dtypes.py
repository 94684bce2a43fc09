"""A plain GEMM on this device with bfloat16 operands vs float32 ones, per operand layout.

The emulated MX GEMM feeds ``lax.dot_general`` bfloat16 operands (exact for MX elements) with
float32 accumulation; this script shows what that costs against float32 operands on the device
at hand, for the three layouts a training step uses (M = N = K, operands cast before timing):

- ``NT``: ``x[M, K] . w[N, K]`` over K, both operands K-last (the forward GEMM);
- ``NN``: ``g[M, N] . w[N, K]`` over N (the data-gradient GEMM);
- ``TN``: ``g[M, N] . x[M, K]`` over M, both K-first (the weight-gradient GEMM).

    python benchmarks/gemm_dtypes.py --sizes 1024 2048
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from jax import lax
from timing import interleaved_medians

LAYOUTS = {
    "NT": (((1,), (1,)), ((), ())),
    "NN": (((1,), (0,)), ((), ())),
    "TN": (((0,), (0,)), ((), ())),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} cores); "
        f"medians of {args.repeats} interleaved repeats; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'M=N=K':>6} {'layout':>6} {'f32 ms':>9} {'bf16 ms':>9} {'bf16/f32':>9}")
    for n in args.sizes:
        keys = jax.random.split(jax.random.key(n))
        a = jax.random.normal(keys[0], (n, n), jnp.float32)
        b = jax.random.normal(keys[1], (n, n), jnp.float32)
        operands = {"f32": (a, b), "bf16": (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))}
        for layout, dims in LAYOUTS.items():
            gemm = jax.jit(
                lambda a, b, dims=dims: lax.dot_general(
                    a, b, dims, preferred_element_type=jnp.float32
                )
            )
            fns = {dtype: (lambda ab=ab, gemm=gemm: gemm(*ab)) for dtype, ab in operands.items()}
            t = interleaved_medians(fns, (), args.repeats)
            f32, bf16 = t["f32"].seconds, t["bf16"].seconds
            print(
                f"{n:>6} {layout:>6} {f32 * 1e3:>9.1f} {bf16 * 1e3:>9.1f} {bf16 / f32:>9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
