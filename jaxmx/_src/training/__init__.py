"""Layer 4, the training GEMMs: custom-VJP ``dot_general``, ``einsum``, attention and
``ragged_dot``, which quantize each GEMM's operands along its own reduction axis, and the scope
(stochastic-rounding keys, GEMM names, the active observer) they read."""
