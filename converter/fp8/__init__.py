"""FP8 training (issue 34): ``converter.fp8.kernels`` holds the torch-only numeric core (scales, casts, Fp8Linear)."""
