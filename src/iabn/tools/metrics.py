"""Segmentation metrics from a confusion matrix accumulated over batches (and ranks).

``matrix[t, p]`` counts pixels of true class ``t`` predicted as ``p`` (rows: ground truth, as
``sklearn.metrics.confusion_matrix``); pixels whose target is ``ignore_index`` are not counted.
From it: per-class IoU ``tp / (tp + fp + fn)``, mean IoU over the classes present (those in the
ground truth or the predictions: a class that never occurs and is never predicted says nothing
and is left out), and pixel accuracy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class ConfusionMatrix:
    """Accumulates a ``num_classes x num_classes`` int64 confusion matrix on ``device``.

    ``update`` per batch, ``all_reduce`` once at the end of a distributed evaluation (each rank
    having seen its own share of the data), then read :meth:`iou`, :meth:`mean_iou` and
    :meth:`pixel_accuracy`. With NCCL, put the matrix on the rank's GPU (``device``).
    """

    def __init__(self, num_classes: int, ignore_index: int = 255,
                 device: torch.device | str | None = None) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes}: need at least one class")
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.matrix.zero_()

    def update(self, prediction: Tensor, target: Tensor) -> None:
        """Count one batch. ``prediction``: class ids shaped like ``target``, or logits
        ``[N, num_classes, *spatial]`` (their argmax over dim 1 is taken); ``target``: class
        ids, ``ignore_index`` where void. Checked before anything is counted."""
        if prediction.dim() == target.dim() + 1:
            if prediction.shape[1] != self.num_classes:
                raise ValueError(f"logits of shape {tuple(prediction.shape)} have "
                                 f"{prediction.shape[1]} classes in dim 1, this matrix "
                                 f"{self.num_classes}")
            prediction = prediction.argmax(1)
        if prediction.shape != target.shape:
            raise ValueError(f"prediction {tuple(prediction.shape)} and target "
                             f"{tuple(target.shape)}: give class ids of the target's shape or "
                             f"logits [N, C, *spatial]")
        for name, ids in (("prediction", prediction), ("target", target)):
            if ids.is_floating_point() or ids.is_complex():
                raise ValueError(f"{name} has dtype {ids.dtype}: class ids must be integers "
                                 f"(pass logits with the class dimension to take the argmax)")
        valid = target != self.ignore_index
        truth, predicted = target[valid].long(), prediction[valid].long()
        for name, ids in (("target", truth), ("prediction", predicted)):
            if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_classes):
                raise ValueError(f"{name} has class ids outside [0, {self.num_classes}) "
                                 f"(min {int(ids.min())}, max {int(ids.max())}) that are not "
                                 f"ignore_index={self.ignore_index}")
        counts = torch.bincount(truth * self.num_classes + predicted,
                                minlength=self.num_classes**2)
        self.matrix += counts.view(self.num_classes, self.num_classes).to(self.matrix.device)

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> None:
        """Sum the matrices of every rank of ``group`` in place (all ranks must call it); a
        no-op without an initialised ``torch.distributed`` process group."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.matrix, op=dist.ReduceOp.SUM, group=group)

    @property
    def pixels(self) -> int:
        """Pixels counted so far (ignored ones excluded)."""
        return int(self.matrix.sum())

    def iou(self) -> Tensor:
        """Per-class intersection over union, float64 ``[num_classes]``; NaN for a class that
        is neither in the ground truth nor predicted."""
        matrix = self.matrix.double()
        hits = matrix.diagonal()
        union = matrix.sum(0) + matrix.sum(1) - hits
        return torch.where(union > 0, hits / union.clamp(min=1), torch.nan)

    def mean_iou(self) -> float:
        """Mean IoU over the classes present (NaN while nothing has been counted)."""
        return float(self.iou().nanmean())

    def pixel_accuracy(self) -> float:
        """Share of counted pixels predicted right (NaN while nothing has been counted)."""
        total = self.pixels
        return float(self.matrix.diagonal().sum()) / total if total else float("nan")


__all__ = ["ConfusionMatrix"]
