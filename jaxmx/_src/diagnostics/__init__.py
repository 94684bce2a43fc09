"""Layer 6, diagnostics: per-block statistics of a quantization, the GEMM accumulation probe,
in-training telemetry of every training GEMM's legs, and the granularity advisor (which
scaling level each tensor or GEMM leg needs)."""
