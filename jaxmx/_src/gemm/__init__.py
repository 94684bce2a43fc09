"""Layer 3, GEMMs on quantized operands: the capabilities of this machine, the one dispatcher
that picks each GEMM's kernel per lowering platform, the emulated kernels and the native
custom calls (with their partitioning and batching rules)."""
