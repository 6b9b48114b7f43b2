"""pagedlm's CUDA platform: Triton paged-attention kernels, CUDA graphs, FlashAttention when present.

Importing this package is cheap and imports neither triton nor flash_attn; the kernel modules are
reached only once the CUDA platform (or the ``triton`` attention backend) has been selected.
"""
