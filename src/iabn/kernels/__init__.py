"""Math only: the kernels behind the layers, chosen per call by :mod:`.dispatch`.

:mod:`.reference` is pure PyTorch (the default on CPU and CUDA, the benchmark baseline);
:mod:`.triton_kernels` / :mod:`.triton_backend` are the fused Triton kernels for CUDA tensors
(opt-in: ``IABN_BACKEND=triton``);
:mod:`.sync_reference` holds the math of the synchronised layer around its collectives.
"""
