"""ConfusionMatrix against scikit-learn (confusion_matrix, jaccard_score, accuracy_score) on the
non-ignored pixels, accumulation over batches, a real two-rank all_reduce (gloo), errors."""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.metrics import accuracy_score, confusion_matrix, jaccard_score

from iabn.tools.metrics import ConfusionMatrix

IGNORE = 255
CLASSES = 6


def _batch(seed, shape=(2, 7, 9), classes=CLASSES, absent=(4,), ignored_share=0.2):
    """Targets and predictions that mostly agree; class ``absent`` never occurs anywhere."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, shape, generator=generator)
    prediction = torch.where(torch.rand(shape, generator=generator) < 0.6, target,
                             torch.randint(0, classes, shape, generator=generator))
    for cls in absent:
        target[target == cls] = 0
        prediction[prediction == cls] = 1
    target[torch.rand(shape, generator=generator) < ignored_share] = IGNORE
    return prediction, target


def _valid_pixels(batches):
    truth = np.concatenate([t.flatten().numpy() for _, t in batches])
    predicted = np.concatenate([p.flatten().numpy() for p, _ in batches])
    keep = truth != IGNORE
    return truth[keep], predicted[keep]


def test_accumulated_matrix_and_scores_match_sklearn():
    batches = [_batch(seed) for seed in range(3)]
    metric = ConfusionMatrix(CLASSES, IGNORE)
    for prediction, target in batches:
        metric.update(prediction, target)
    truth, predicted = _valid_pixels(batches)
    labels = list(range(CLASSES))
    np.testing.assert_array_equal(metric.matrix.numpy(),
                                  confusion_matrix(truth, predicted, labels=labels))
    assert metric.pixels == truth.size
    present = sorted(set(truth) | set(predicted))
    assert 4 not in present  # the absent class is left out of the mean
    iou = metric.iou().numpy()
    np.testing.assert_allclose(iou[present], jaccard_score(truth, predicted, labels=present,
                                                           average=None))
    assert np.isnan(iou[4])
    assert metric.mean_iou() == pytest.approx(jaccard_score(truth, predicted, average="macro"))
    assert metric.pixel_accuracy() == pytest.approx(accuracy_score(truth, predicted))


def test_logits_count_as_their_argmax():
    prediction, target = _batch(5)
    logits = torch.randn(2, CLASSES, 7, 9) + 10 * torch.nn.functional.one_hot(
        prediction, CLASSES).permute(0, 3, 1, 2)
    from_logits, from_ids = ConfusionMatrix(CLASSES), ConfusionMatrix(CLASSES)
    from_logits.update(logits, target)
    from_ids.update(prediction, target)
    assert torch.equal(from_logits.matrix, from_ids.matrix)


def test_ignore_index_and_reset():
    prediction, target = _batch(1, ignored_share=0.0)
    metric = ConfusionMatrix(CLASSES, ignore_index=-1)
    target[0] = -1
    metric.update(prediction, target)
    assert metric.pixels == target[1].numel()
    metric.reset()
    assert metric.pixels == 0
    assert np.isnan(metric.mean_iou()) and np.isnan(metric.pixel_accuracy())


def test_perfect_prediction_scores_one():
    _, target = _batch(2)
    metric = ConfusionMatrix(CLASSES)
    metric.update(target.clone().masked_fill(target == IGNORE, 0), target)
    assert metric.mean_iou() == 1.0 and metric.pixel_accuracy() == 1.0


def test_bad_batches_are_rejected_before_counting():
    metric = ConfusionMatrix(CLASSES)
    prediction, target = _batch(3)
    bad_target = target.clone()
    bad_target[0, 0, 0] = CLASSES  # neither a class nor the ignore index
    with pytest.raises(ValueError, match=r"target has class ids outside \[0, 6\)"):
        metric.update(prediction, bad_target)
    with pytest.raises(ValueError, match="prediction has class ids outside"):
        metric.update(prediction.masked_fill(target == IGNORE, 0) - 1, target)
    with pytest.raises(ValueError, match=r"prediction \(2, 7, 8\) and target \(2, 7, 9\)"):
        metric.update(prediction[..., :8], target)
    with pytest.raises(ValueError, match="have 5 classes in dim 1"):
        metric.update(torch.randn(2, 5, 7, 9), target)
    with pytest.raises(ValueError, match="must be integers"):
        metric.update(prediction.float(), target)
    with pytest.raises(ValueError, match="num_classes=0"):
        ConfusionMatrix(0)
    assert metric.pixels == 0  # nothing was counted by the rejected batches


def test_all_reduce_without_a_process_group_changes_nothing():
    metric = ConfusionMatrix(CLASSES)
    metric.update(*_batch(4))
    before = metric.matrix.clone()
    metric.all_reduce()
    assert torch.equal(metric.matrix, before)


def _all_reduce_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    metric = ConfusionMatrix(CLASSES)
    metric.update(*_batch(10 + rank, shape=(1 + rank, 5, 6)))  # different shares per rank
    metric.all_reduce()
    every_rank = [_batch(10 + r, shape=(1 + r, 5, 6)) for r in range(world)]
    truth, predicted = _valid_pixels(every_rank)
    np.testing.assert_array_equal(metric.matrix.numpy(),
                                  confusion_matrix(truth, predicted, labels=range(CLASSES)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_sums_the_ranks_matrices():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_all_reduce_worker, args=(2, port), nprocs=2, join=True)
