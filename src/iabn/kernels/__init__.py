"""Math only: the kernels behind the layers, chosen per call by :mod:`.backends`.

Two backends keep one contract (:class:`.backend.KernelBackend`: forward, backward, and the
two halves of the synchronised layer's backward): :mod:`.reference`, on PyTorch's own
batch-norm kernels (the default on CPU and CUDA, the benchmark baseline), and
:mod:`.triton_backend` with its kernels :mod:`.triton_kernels` (opt-in:
``IABN_BACKEND=triton``). :mod:`.common` holds what both share; :mod:`.traceable` is the
same math in functional ATen operations, for the compiler; :mod:`.scratch` the reference
backward's reused CPU buffers.
"""
