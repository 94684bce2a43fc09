"""Optimizers whose state is stored in low precision: Adam's moments in bfloat16, 8-bit or 4-bit
code maps with block absmax scales, or FP8 with block scales, as optax transforms."""
