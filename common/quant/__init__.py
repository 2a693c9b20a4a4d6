"""Trainer-side quantizers that turn bf16 weights into an engine's quantized checkpoint format."""
