"""The reference backend: every function of the contract (:class:`.backend.KernelBackend`) on
PyTorch's own kernels, CPU and CUDA alike. The default backend and the benchmarks' baseline.

Each op family's math lives in its own module, and this one names which function of the
contract comes from where (docs/design.md, "Adding a backend"):

- the batch-norm layers (and the synchronised layer's two halves): :mod:`.batch_norm`;
- the group-norm layers: :mod:`.group_norm`;
- the layer and RMS norms (row norms): :mod:`.row_norm`;
- the activations without a norm: :mod:`.branch`.

No autograd here: the layers' ``Function``\\ s call these (``iabn.autograd``), as the
``torch.library`` operators of :mod:`iabn.autograd.operators` do.
"""

from __future__ import annotations

from .batch_norm import backward, forward_, input_grad, local_sums
from .branch import activation_grad
from .group_norm import group_norm_backward, group_norm_forward_
from .row_norm import row_norm_backward, row_norm_forward

__all__ = [
    "activation_grad",
    "backward",
    "forward_",
    "group_norm_backward",
    "group_norm_forward_",
    "input_grad",
    "local_sums",
    "row_norm_backward",
    "row_norm_forward",
]
