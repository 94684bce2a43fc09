"""Layer 1, what things are: formats, quantized arrays and recipes as data, exact float32 bit
arithmetic, the scale layouts and the block-versus-shard rules. Nothing here quantizes or
multiplies; every other layer builds on it."""
