"""Which part of a recipe costs training-step memory: one recipe field changed at a time.

The MLP of ``step_memory.py`` (unrolled, float32 masters cast to bfloat16, no remat) at
``--tokens 256 --features 256 --hidden 1024``; each row a preset recipe or one with fields
replaced (``dataclasses.replace``); temporary bytes of the compiled step
(``compiled.memory_analysis()``, no run) and their ratio to the bfloat16 step's.

    python benchmarks/step_memory_ablation.py
"""

from __future__ import annotations

import dataclasses

from step_memory import memory, mlp_args, mlp_step

import jaxmx

R = jaxmx.recipes
ROWS = {
    "MXFP8": R.MXFP8,
    'MXFP8, grad_rounding="stochastic"': dataclasses.replace(R.MXFP8, grad_rounding="stochastic"),
    "MXFP4": R.MXFP4,
    "MXFP4, rht=False": dataclasses.replace(R.MXFP4, rht=False),
    "MXFP4, weight_tile=None": dataclasses.replace(R.MXFP4, weight_tile=None),
    'MXFP4, grad_rounding="nearest"': dataclasses.replace(R.MXFP4, grad_rounding="nearest"),
    "MXFP4, all three": dataclasses.replace(
        R.MXFP4, rht=False, grad_rounding="nearest", weight_tile=None
    ),
    "DEEPSEEK_FP8": R.DEEPSEEK_FP8,
    "DEEPSEEK_FP8, weight_tile=None": dataclasses.replace(R.DEEPSEEK_FP8, weight_tile=None),
}


def main() -> None:
    args = mlp_args(256, 256, 1024)
    base = memory(mlp_step(None, None), None, *args)[0]
    print(f"{'recipe':36s} {'temp MiB':>9s} {'/ bf16':>7s}")
    print(f"{'bf16':36s} {base / 2**20:9.2f} {1:7.3f}")
    for name, recipe in ROWS.items():
        temp = memory(mlp_step(recipe, None), recipe, *args)[0]
        print(f"{name:36s} {temp / 2**20:9.2f} {temp / base:7.3f}", flush=True)


if __name__ == "__main__":
    main()
