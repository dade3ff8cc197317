"""Math only: the pure-PyTorch reference path (CPU, and the oracle for GPU kernels)."""
