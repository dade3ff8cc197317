"""Image transforms of the ImageNet training and evaluation pipelines, on torchvision's
``transforms.v2``.

Training (as the original scripts): a random crop (random area and aspect ratio, or a fixed
shorter side then a random square), a horizontal flip, colour jitter (brightness, contrast and
saturation), AlexNet's PCA lighting noise, normalisation. Evaluation: shorter side resized to
``scale``, then the centre ``crop`` or ten crops (four corners and the centre, and their mirror
images).

Inputs are ``uint8 [3, H, W]`` RGB tensors (as :mod:`iabn.tools.data.imagefolder` decodes them);
outputs ``float32``, normalised. The random draws come from torch's global generator, as in any
``transforms.v2`` pipeline; :class:`TransformedDataset` seeds it per sample (and restores it),
so a sample's augmentation is a function of its seed (see :mod:`iabn.tools.data.samplers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

# AlexNet's principal components of ImageNet RGB pixels in [0, 1] (eigenvalues, and the
# eigenvectors as columns), the constants every ImageNet "lighting" augmentation uses.
LIGHTING_EIGENVALUES = (0.2175, 0.0188, 0.0045)
LIGHTING_EIGENVECTORS = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)


class PCALighting(v2.Transform):
    """AlexNet's lighting noise, which torchvision lacks: add ``V @ (alpha * eigenvalues)`` to
    every pixel of a float image in [0, 1], where ``V`` holds the eigenvectors as columns and
    ``alpha ~ N(0, std)`` per component (one draw per call)."""

    def __init__(self, std: float) -> None:
        super().__init__()
        self.std = std

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        alpha = torch.randn(3, dtype=torch.float64) * self.std
        vectors = torch.tensor(LIGHTING_EIGENVECTORS, dtype=torch.float64)
        return {"shift": vectors @ (alpha * torch.tensor(LIGHTING_EIGENVALUES,
                                                         dtype=torch.float64))}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        return inpt + params["shift"].to(inpt.dtype).view(3, 1, 1)


def _bilinear() -> dict[str, Any]:
    return {"interpolation": v2.InterpolationMode.BILINEAR, "antialias": True}


class TrainTransform(v2.Compose):
    """The training augmentation (module doc). ``scale=None``: ``v2.RandomResizedCrop``
    (``area_range`` of the image's area, aspect ratio w/h log-uniform in ``ratio_range``); an
    integer: shorter side resized to ``scale``, then ``v2.RandomCrop``. Then a random
    horizontal flip (``flip``), ``v2.ColorJitter`` of brightness, contrast and saturation
    ``jitter``, :class:`PCALighting` of std ``lighting`` (0 switches either off), and
    ``v2.Normalize``."""

    def __init__(self, crop: int, scale: int | None, area_range: Sequence[float],
                 ratio_range: Sequence[float], flip: bool, jitter: float, lighting: float,
                 mean: Sequence[float], std: Sequence[float]) -> None:
        self.crop, self.scale = crop, scale
        self.area_range, self.ratio_range = tuple(area_range), tuple(ratio_range)
        self.flip, self.jitter, self.lighting = flip, jitter, lighting
        self.mean, self.std = tuple(mean), tuple(std)
        if scale is None:
            steps: list[Callable] = [v2.RandomResizedCrop(crop, scale=self.area_range,
                                                          ratio=self.ratio_range, **_bilinear())]
        else:
            steps = [v2.Resize(scale, **_bilinear()), v2.RandomCrop(crop)]
        if flip:
            steps.append(v2.RandomHorizontalFlip())
        steps.append(v2.ToDtype(torch.float32, scale=True))
        if jitter > 0:
            steps.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter))
        if lighting > 0:
            steps.append(PCALighting(lighting))
        steps.append(v2.Normalize(self.mean, self.std))
        super().__init__(steps)

    def forward(self, image: Tensor) -> Tensor:
        return super().forward(tv_tensors.Image(image)).as_subclass(Tensor)


class EvalTransform(v2.Compose):
    """Shorter side to ``scale``, then the centre ``crop`` (``[3, crop, crop]``) or, with
    ``ten_crops``, a ``[10, 3, crop, crop]`` stack (``v2.TenCrop``: top-left, top-right,
    bottom-left, bottom-right and centre crops, then the same five of the mirrored image),
    normalised. ``mirror=False`` (a model trained without flips) keeps the five crops of the
    image itself (``v2.FiveCrop``, ``[5, 3, crop, crop]``): mirrored images are inputs such a
    model never saw. ``views`` is the number of crops per image."""

    def __init__(self, scale: int, crop: int, ten_crops: bool, mean: Sequence[float],
                 std: Sequence[float], mirror: bool = True) -> None:
        if crop > scale:
            raise ValueError(f"crop {crop} is larger than scale {scale}: the crop must fit "
                             f"inside the resized image")
        self.scale, self.crop, self.ten_crops, self.mirror = scale, crop, ten_crops, mirror
        self.views = (10 if mirror else 5) if ten_crops else 1
        self.mean, self.std = tuple(mean), tuple(std)
        corners = v2.TenCrop(crop) if mirror else v2.FiveCrop(crop)
        super().__init__([
            v2.Resize(scale, **_bilinear()),
            corners if ten_crops else v2.CenterCrop(crop),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(self.mean, self.std),
        ])

    def forward(self, image: Tensor) -> Tensor:
        # an Image, not a plain tensor: v2 would pass all of TenCrop's crops but the first by
        # untransformed (it takes only the first plain tensor of a sample for the image)
        out = super().forward(tv_tensors.Image(image))
        if self.ten_crops:
            return torch.stack([crop.as_subclass(Tensor) for crop in out])
        return out.as_subclass(Tensor)


Transform = Callable[[Tensor], Tensor]


class TransformedDataset(Dataset):
    """``(transform(image), label)`` for every ``(image, label)`` of ``source``.

    Keys are plain indices (the transform draws from torch's global generator, if it draws at
    all) or the ``(index, seed)`` pairs of :class:`~iabn.tools.data.samplers.ShuffledShardSampler`:
    then the transform runs with torch's CPU generator seeded by ``seed``, and the generator's
    state is restored afterwards.
    """

    def __init__(self, source: Dataset, transform: Transform) -> None:
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.source[index]
        if seed is None:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(image), label


__all__ = [
    "LIGHTING_EIGENVALUES",
    "LIGHTING_EIGENVECTORS",
    "EvalTransform",
    "PCALighting",
    "TrainTransform",
    "TransformedDataset",
]
