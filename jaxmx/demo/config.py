"""The demo's settings without its training code: the model and schedule (:class:`Config`) and
the recipe names of ``--recipe``. Imports nothing heavy, so that the command line (argparse,
:mod:`jaxmx.demo.cli`) answers ``--help`` before flax, optax and orbax load.

Example:
    >>> Config(steps=10).steps, KEEP_LAST.get("nvfp4", 0)
    (10, 1)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Model size and training schedule. The defaults are the measured ones in docs/demo.md."""

    steps: int = 600
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    seq_len: int = 128
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int | None = None  # validation batches per evaluation (None: the whole split)
    seed: int = 0
    keep_last: int = 0  # under a recipe, the last blocks whose linear layers stay in BF16
    save_activations: str | None = None  # jaxmx.SAVE_FORMATS: blocks' saved inputs in 8/12 bits


RECIPES = (
    "mxfp8",
    "mxfp8_hybrid",
    "mxfp8_2d",
    "deepseek_fp8",
    "fp8_block_pow2",
    "fp8_tensorwise",
    "fp8_rowwise",
    "fp8_rowwise_gw_hp",
    "mxfp6_e2m3",
    "mxfp6_e3m2",
    "mxint8",
    "nvfp4",
    "mxfp4",
)

FORMAT_RECIPES = ("mxfp6_e2m3", "mxfp6_e3m2", "mxint8")
"""Demo recipes without a ``jaxmx.recipes`` preset: one format for every operand,
``jaxmx.Recipe(fwd=name, grad=name)`` (rceil scales)."""

KEEP_LAST = {"nvfp4": 1, "mxfp4": 1}
"""The default ``Config.keep_last`` of a demo recipe (0 if not listed): NVIDIA's NVFP4 recipe
keeps the last blocks in higher precision."""
