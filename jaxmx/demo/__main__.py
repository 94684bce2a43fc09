"""A short tour of MX quantization: ``python -m jaxmx.demo``."""

import jax
import jax.numpy as jnp

import jaxmx


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (4, 64), jnp.float32) * jnp.array(
        [[1e-3], [1], [1e3], [1e6]]
    )
    for fmt in jaxmx.FORMATS:
        q = jaxmx.quantize(x, fmt)
        err = jnp.abs(jaxmx.dequantize(q) - x) / jnp.abs(x)
        bytes_ = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)[:, 0].tolist()
        print(f"{fmt:11s} scale bytes {bytes_}  max relative error {float(err.max()):.4f}")


if __name__ == "__main__":
    main()
