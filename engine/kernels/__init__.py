"""Triton kernels for the GPU path (the torch code in `engine/attention.py` is the reference).

Tested on CPU with the Triton interpreter (`TRITON_INTERPRET=1`) against the torch reference;
on CUDA they run compiled. Importing this package needs `triton`.
"""
