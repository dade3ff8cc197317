"""Math only: the kernels behind the layers, chosen per call by :mod:`.dispatch`.

:mod:`.reference` is pure PyTorch (the CPU path, the test oracle, the benchmark baseline);
:mod:`.triton_kernels` / :mod:`.triton_backend` are the fused Triton kernels for CUDA tensors;
:mod:`.sync_reference` holds the math of the synchronised layer around its collectives.
"""
