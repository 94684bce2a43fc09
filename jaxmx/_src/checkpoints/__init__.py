"""Checkpoints in the formats other tools ship: Hugging Face style directories of safetensors
shards whose quantized weights (transformers' fine-grained FP8 and MXFP4, compressed-tensors,
NVIDIA ModelOpt) are read into MXArrays and written back, bit for bit."""
