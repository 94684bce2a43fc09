"""Diagnostics: what MX quantization does to a tensor, a GEMM and a training step.

- :func:`block_stats` gives, for every quantization block, its absolute maximum and scale, how
  far an outlier stretches it (``span_ratio``), and the fractions of its elements that underflow
  to subnormals, flush to zero or saturate, with its SQNR; :meth:`BlockStats.summary` reduces
  them to tail statistics and histograms.
- :func:`gemm_probe` measures the accumulation error of an MX GEMM under a limited-precision
  accumulator model (the same model as ``Recipe(accum_bits=...)``).
- :func:`telemetry` records, inside a jitted training step and without host callbacks, the tail
  statistics of every leg of every jaxmx GEMM (forward operands, the gradient's two copies);
  :func:`telemetry_report` collects them by GEMM name and :func:`first_nonfinite` finds where a
  NaN or inf first appeared.
- :func:`granularity` quantizes a tensor at every scaling level (per tensor, per row, 128x128
  tiles, 1x128 blocks, MX 32-blocks, NVFP4 16-blocks) and recommends the coarsest that keeps
  underflow within a budget; :func:`advise` does it for every GEMM leg of a training step, and
  :func:`advised_recipes` turns its advice into ``quantize_model``'s per-layer recipes.
- :func:`memory_report` compiles a training step and reports its parameters', gradients',
  optimizer state's, saved activations' and temporaries' bytes beside a baseline step's
  (docs/memory_report.md).
- :func:`collective_bytes` reads a compiled SPMD program's collectives (all-gather, all-reduce,
  reduce-scatter, all-to-all) and the bytes each moves, by dtype: what crosses the wire in 8 bits.

See docs/diagnostics.md.

Example:
    >>> import jax, jaxmx
    >>> x = jax.random.normal(jax.random.key(0), (64, 256))
    >>> s = jaxmx.diagnostics.block_stats(x)
    >>> s.span_ratio.shape, s.summary()["saturated_max"]
    ((64, 8), 0.0)
"""

from jaxmx._src.diagnostics.advice import LEVEL_RECIPES, Advice, LayerAdvice, advised_recipes
from jaxmx._src.diagnostics.advise import advise
from jaxmx._src.diagnostics.block_stats import BlockStats, block_stats, gemm_probe
from jaxmx._src.diagnostics.collectives import COLLECTIVES, CollectiveBytes, collective_bytes
from jaxmx._src.diagnostics.granularity import Granularity, Recommendation, granularity
from jaxmx._src.diagnostics.level_stats import LevelStats
from jaxmx._src.diagnostics.levels import ELEMENTS, LEVELS
from jaxmx._src.diagnostics.memory import KINDS, MemoryReport, memory_report
from jaxmx._src.diagnostics.telemetry import (
    LEGS,
    ForwardLegs,
    GemmTelemetry,
    GradientLegs,
    LegStats,
    Telemetry,
    first_nonfinite,
    gemm_taps,
    leg_stats,
    telemetry,
    telemetry_report,
)
from jaxmx._src.training.scope import named

__all__ = [
    "COLLECTIVES",
    "ELEMENTS",
    "KINDS",
    "LEGS",
    "LEVELS",
    "LEVEL_RECIPES",
    "Advice",
    "BlockStats",
    "CollectiveBytes",
    "ForwardLegs",
    "GemmTelemetry",
    "GradientLegs",
    "Granularity",
    "LayerAdvice",
    "LegStats",
    "LevelStats",
    "MemoryReport",
    "Recommendation",
    "Telemetry",
    "advise",
    "advised_recipes",
    "block_stats",
    "collective_bytes",
    "first_nonfinite",
    "gemm_probe",
    "gemm_taps",
    "granularity",
    "leg_stats",
    "memory_report",
    "named",
    "telemetry",
    "telemetry_report",
]
