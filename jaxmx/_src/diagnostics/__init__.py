"""Layer 6, diagnostics: per-block statistics of a quantization, the GEMM accumulation probe,
and in-training telemetry of every training GEMM's legs."""
