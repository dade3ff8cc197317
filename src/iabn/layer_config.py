"""The layer's settings for one call, as one value passed from the layer through the operators
to the kernels (instead of six scalar arguments at every boundary)."""

from __future__ import annotations

from typing import NamedTuple


class LayerConfig(NamedTuple):
    """What a norm + activation call computes, apart from its tensors.

    A ``NamedTuple``: immutable and hashable (usable as a cache key, e.g. for launch settings
    that depend on the options), and cheap to build and to pass through
    ``torch.autograd.Function.apply``, whose per-argument cost is measurable on small layers.
    The registered ``torch.library`` operators take the fields as scalars (their schema allows
    no Python objects); :mod:`iabn.ops` converts at that boundary.
    """

    training: bool          # normalise with batch statistics (and update the running ones)
    momentum: float         # running-statistics factor (0 when not updating)
    eps: float              # added to the variance; the smallest |scale| of the in-place layer
    activation: str         # "leaky_relu", "elu", "identity" (and "relu" for ABN)
    activation_param: float  # leaky_relu's negative slope or elu's alpha
    gamma_mode: str         # "signed" or "abs" (iabn.scale)
    variant: int = 2        # the paper's backward variant (1 or 2)

    def for_eval(self) -> LayerConfig:
        """The same layer normalising with given statistics, updating nothing (the synchronised
        layer's forward after its statistics are merged)."""
        return self._replace(training=False, momentum=0.0)


__all__ = ["LayerConfig"]
