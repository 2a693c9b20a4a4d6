"""Kernels of the hot loops: the pack / scatter (Triton on CUDA), the device-side hash and the
native C++ checks and memcpy loops. Imports nothing else of refit."""
