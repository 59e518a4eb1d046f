"""Torch-only GEMM kernels that converted graphs call and that model.py carries verbatim."""
