"""Triton kernels of the CUDA backend (imported only after the CUDA platform is chosen)."""
