"""Test-wide setup: 8 CPU devices, so multi-device tests run in this process.

Set before any computation initialises the backend. Single-device tests are unaffected: arrays
and computations stay on device 0 unless a test shards them.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
