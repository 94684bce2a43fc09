"""Diagnostics: what MX quantization does to a tensor, block by block.

:func:`block_stats` gives, for every quantization block, its absolute maximum and scale, how far
an outlier stretches it (``span_ratio``), and the fractions of its elements that underflow to
subnormals, flush to zero or saturate, with its SQNR; :meth:`BlockStats.summary` reduces them to
tail statistics and histograms. :func:`gemm_probe` measures the accumulation error of an MX GEMM
under a limited-precision accumulator model. See docs/diagnostics.md.

Example:
    >>> import jax, jaxmx
    >>> x = jax.random.normal(jax.random.key(0), (64, 256))
    >>> s = jaxmx.diagnostics.block_stats(x)
    >>> s.span_ratio.shape, s.summary()["saturated_max"]
    ((64, 8), 0.0)
"""

from jaxmx._src.diagnostics import BlockStats, block_stats, gemm_probe

__all__ = ["BlockStats", "block_stats", "gemm_probe"]
