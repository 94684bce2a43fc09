"""Optimizers with low-precision state, as optax transforms.

- :func:`adam`, :func:`adamw`, :func:`scale_by_adam`: Adam whose first and second moments are
  stored in ``"bfloat16"``, ``"8bit"`` (code maps, block absmax scales), ``"fp8"`` (E4M3, block
  scales) or ``"4bit"`` (code maps, two codes per byte), quantized inside ``update``; the state
  is arrays that orbax saves as they are.
- :func:`state_report` lists each stored moment (format, bytes, why a small parameter stays
  float32); :func:`state_bytes` counts a state's device bytes.
- :func:`bf16_stochastic_round`: bfloat16 master weights updated with stochastic rounding.

Needs optax (the ``optim`` extra); import it explicitly: ``import jaxmx.optim``. See
docs/optimizers.md.

Example:
    >>> import jax.numpy as jnp, jaxmx.optim
    >>> params = {"w": jnp.ones((64, 256))}
    >>> tx = jaxmx.optim.adamw(1e-3, state_format="8bit")
    >>> state = tx.init(params)
    >>> jaxmx.optim.state_bytes(state) / jaxmx.optim.state_bytes(jaxmx.optim.adamw(
    ...     1e-3, state_format="float32").init(params))
    0.2539...
"""

from jaxmx._src.optim.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from jaxmx._src.optim.code_maps import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED,
    LINEAR_4BIT_UNSIGNED,
)
from jaxmx._src.optim.master_weights import StochasticRoundState, bf16_stochastic_round
from jaxmx._src.optim.moments import MOMENT_FORMATS, BlockMoment, DenseMoment
from jaxmx._src.optim.report import MomentRow, StateReport, state_bytes, state_report

__all__ = [
    "DYNAMIC_4BIT_SIGNED",
    "DYNAMIC_8BIT_SIGNED",
    "DYNAMIC_8BIT_UNSIGNED",
    "LINEAR_4BIT_UNSIGNED",
    "MOMENT_FORMATS",
    "BlockMoment",
    "DenseMoment",
    "MomentRow",
    "ScaleByAdamState",
    "StateReport",
    "StochasticRoundState",
    "adam",
    "adamw",
    "bf16_stochastic_round",
    "scale_by_adam",
    "state_bytes",
    "state_report",
]
