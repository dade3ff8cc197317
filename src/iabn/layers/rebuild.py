"""A layer of another class made on an old layer's very tensors, for ``iabn.convert`` and the
synchronised layers' converters (``convert_sync``, ``convert_local``): optimizers and DDP,
which hold references to those tensors, keep working."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def holding_tensors_of(layer: nn.Module, source: nn.Module) -> nn.Module:
    """``layer`` (built on the meta device) made to hold ``source``'s very tensors: each
    parameter and buffer ``layer`` registers is replaced by ``source``'s of the same name, and
    ``layer`` takes ``source``'s training mode. Optimizers and DDP hold references to those
    tensors, and their ``requires_grad`` flags carry over; nothing is copied."""
    for name in (*layer._parameters, *layer._buffers):
        setattr(layer, name, getattr(source, name))
    return layer.train(source.training)


Layer = TypeVar("Layer", bound=nn.Module)


def rebuilt_as(source: nn.Module, cls: type[Layer], activation: str, activation_param: float,
               **options: Any) -> Layer:
    """A ``cls`` layer to take ``source``'s place, holding its very tensors
    (:func:`holding_tensors_of`): built on the meta device with ``source``'s normalisation
    settings (``num_features, eps, momentum, affine, track_running_stats`` of a batch norm,
    ``nn.SyncBatchNorm`` or :class:`ABN`; ``num_groups, num_channels, eps, affine`` of an
    ``nn.GroupNorm`` or :class:`iabn.GroupNormAct`), then ``activation, activation_param`` and
    the keyword ``options``. ``iabn.convert``, ``convert_sync`` and ``convert_local`` change a
    layer's class this way, so optimizers built on the old layer keep working."""
    if isinstance(source, _NormBase):
        settings = (source.num_features, source.eps, source.momentum, source.affine,
                    source.track_running_stats)
    else:
        settings = (source.num_groups, source.num_channels, source.eps, source.affine)
    if source.affine and source.bias is None:  # nn.BatchNorm2d(C, bias=False) and the like
        options.setdefault("bias", False)
    layer = cls(*settings, activation, activation_param, device="meta", **options)
    return holding_tensors_of(layer, source)
