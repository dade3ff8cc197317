"""Autograd of the in-place layer: the routing of a layer call after its checks and the one
eager ``Function`` (:mod:`.function`), the same layer as ATen operations for the compiler
(:mod:`.compiled`), and the ``torch.library`` operators for direct callers while compiling
(:mod:`.operators`). The math is in :mod:`iabn.kernels`."""
