"""Layer 5, serving: what inference reads, held quantized: the MX KV cache and the attention
over it (QK^T an MX GEMM through the dispatcher, PV on decoded V); weights at rest and their
forward-only GEMM."""
