"""Cutting an activation into parts of whole channels (or rows), so that a backward computing
in float32 for half inputs, or running Newton's temporaries, holds a part's temporaries and not
the whole activation's: the batch-norm, group-norm, row-norm and activation backwards of the
reference backend all cut this way. Math only."""

from __future__ import annotations

from torch import Tensor

#: Parts a half-precision backward computing in float32 is cut into (:func:`pieces`): a
#: part's float32 ``z``, ``dz``, ``y``, ``dy``, ``dx`` and the activation's temporaries
#: (at most 6 x 4 bytes an element of the part) hold at most 1.5 bytes per element of the
#: whole when a part is at most 1/16 of it: under one activation in the input's dtype
#: (2 bytes an element).
PIECES = 16
#: Fewest elements of a part (4 MiB of float32): each part costs its operations' launches
#: again, which a layer of few elements would pay for little memory, so a tensor of fewer
#: than ``PIECES * MIN_PIECE`` elements is cut into fewer parts (one below twice this).
MIN_PIECE = 1 << 20


def pieces(*tensors: Tensor, parts: int = PIECES) -> tuple[list[Tensor], list[tuple]]:
    """``(views, index)``: ``tensors`` (``(N, C, *spatial)``, one shape) seen as
    ``(N, C, L)`` (``L`` the spatial positions; as they are where some cannot be viewed so),
    and index tuples that cut them into parts of whole channels, each at most ``1 / parts``
    of the whole where the positions allow (and :data:`MIN_PIECE` elements allow): along
    ``N``, or with fewer samples than parts, along each sample's ``L`` too."""
    n, c = tensors[0].shape[:2]
    parts = part_count(tensors[0].numel(), parts)
    try:
        views = [t.view(n, c, -1) for t in tensors]
    except RuntimeError:  # spatial dims that do not flatten to a view: cut along N only
        views = list(tensors)
    if n >= parts or views[0].dim() != 3:
        return views, [(slice(a, b),) for a, b in at_most(n, parts)]
    per_sample = -(-parts // n)
    return views, [
        (slice(i, i + 1), slice(None), slice(a, b))
        for i in range(n) for a, b in at_most(views[0].shape[2], per_sample)
    ]


def part_count(numel: int, parts: int = PIECES) -> int:
    """How many parts :func:`pieces` aims at for ``numel`` elements: ``parts``, fewer where a
    part would have under :data:`MIN_PIECE` elements, at least one."""
    return max(1, min(parts, numel // MIN_PIECE))


def at_most(size: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive ranges covering ``range(size)``, each at most
    ``size / parts`` long (at least 1): ``parts`` of them or up to twice as many."""
    step = max(1, size // parts)
    return [(a, min(a + step, size)) for a in range(0, size, step)]
