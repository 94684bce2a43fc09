"""Layer 2, quantization: the scale rules, stochastic rounding and the element codec, the
quantizers built on them (XLA and Pallas), fake quantization, the Hadamard transform."""
