"""Picture of a segmentation model on the embedded digits canvases: for each of a few
validation canvases, the input, the ground truth and the prediction (palette colours of
``iabn segment``), side by side, one canvas per row.

Usage::

    python examples/segmentation_figure.py runs/digits_seg/best.pth docs/segmentation_digits.png
        [--count 4] [--scale 3] [--canvases DIR]

``--canvases DIR`` also writes the input canvases as ``DIR/canvas_N.png``, e.g. to try
``iabn segment`` on them (docs/usage/segmentation.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from iabn.tools.data.segmentation import DigitsCanvas
from iabn.tools.segment import (
    PALETTE,
    SegmentOptions,
    load_segmentation_model,
    predict,
    read_snapshot,
    snapshot_normalisation,
)


def coloured(labels: np.ndarray) -> Image.Image:
    image = Image.fromarray(labels.astype(np.uint8), mode="P")
    image.putpalette(PALETTE)
    return image.convert("RGB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--scale", type=int, default=3, help="pixel magnification")
    parser.add_argument("--canvases", default=None, metavar="DIR",
                        help="also write the input canvases as DIR/canvas_N.png")
    args = parser.parse_args(argv)
    snapshot = read_snapshot(args.snapshot)
    data = snapshot["config"]["data"]
    canvases = DigitsCanvas("val", data["canvas_val"], size=data["canvas_size"],
                            digit_scale=tuple(data["canvas_digit_scale"]),
                            max_digits=data["canvas_max_digits"], seed=data["canvas_seed"],
                            split_seed=data["canvas_seed"])
    model = load_segmentation_model(args.snapshot, data=snapshot)
    mean, std = snapshot_normalisation(snapshot)
    rows = []
    with torch.no_grad():
        for index in range(args.count):
            image, truth = canvases.canvas(index)
            if args.canvases is not None:
                Path(args.canvases).mkdir(parents=True, exist_ok=True)
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(
                    Path(args.canvases) / f"canvas_{index}.png")
            normalised = (image.float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(
                std)[:, None, None]
            labels, _ = predict(model, normalised, SegmentOptions())
            tiles = [Image.fromarray(image.permute(1, 2, 0).numpy()), coloured(truth.numpy()),
                     coloured(labels.numpy())]
            rows.append(np.concatenate([np.asarray(t) for t in tiles], axis=1))
    grid = Image.fromarray(np.concatenate(rows, axis=0))
    grid = grid.resize((grid.width * args.scale, grid.height * args.scale), Image.NEAREST)
    grid.save(args.out)
    print(f"wrote {args.out}: input | ground truth | prediction, {args.count} val canvases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
