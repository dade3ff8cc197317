"""Loading checkpoints of the original ``inplace_abn`` package into iabn's models.

Those files store ``{"state_dict": {"module.<key>": tensor}}`` (ImageNet models) or
``{"state_dict": {"body": ..., "head": ..., "cls": ...}}`` (the Vistas segmentation model) and
were saved before ``num_batches_tracked`` existed. What their norm weights mean depends on the
layer that trained them (the *origin*): the original ``InPlaceABN``/``InPlaceABNSync`` computed
with ``|weight| + eps``, its ``ABN`` (``bn_mode: standard``, the ``stdbn`` files) with the
weight as it is, like ``nn.BatchNorm2d``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..kernels.common import ABS, SIGNED
from ..layers.batch_norm import ABN

IN_PLACE = "InPlaceABN"
"""Origin: the original's in-place layers (``InPlaceABN``, ``InPlaceABNSync``): ``|w| + eps``."""
STANDARD = "ABN"
"""Origin: the original's ``ABN`` (standard batch norm + activation): signed weights."""
AUTO = "auto"
ORIGINS = (AUTO, IN_PLACE, STANDARD)
_ORIGIN_ALIASES = {
    "auto": AUTO, "inplaceabn": IN_PLACE, "inplaceabnsync": IN_PLACE, "inplace": IN_PLACE,
    "sync": IN_PLACE, "abn": STANDARD, "standard": STANDARD, "stdbn": STANDARD,
}


@dataclass
class LoadReport:
    """What :func:`load_original` did: keys it could not fill, and keys nobody wanted."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    origin: str | None = None
    """The original layer type the weights were trained with (``"InPlaceABN"``/``"ABN"``)."""
    origin_reason: str = ""
    """Why that origin: given, or what ``origin="auto"`` found."""
    layers: dict[str, str] = field(default_factory=dict)
    """Norm layer name -> how it now computes: ``"abs"`` / ``"signed"`` (iabn layers'
    ``gamma_mode``), ``"bn |w|+eps"`` (an ``nn.BatchNorm2d`` given ``|w| + eps``) or
    ``"bn"`` (an ``nn.BatchNorm2d`` left as it is)."""
    warnings: list[str] = field(default_factory=list)
    """Notes that do not make the load fail (e.g. abs-trained weights in a signed layer)."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def __str__(self) -> str:
        text = "all keys matched" if self.ok else self._key_problems()
        if self.origin is not None:
            counts: dict[str, int] = {}
            for mode in self.layers.values():
                counts[mode] = counts.get(mode, 0) + 1
            modes = ", ".join(f"{n} {mode}" for mode, n in counts.items()) or "no norm layers"
            text += f"; origin {self.origin} ({self.origin_reason}): {modes}"
        for note in self.warnings:
            text += f"; warning: {note}"
        return text

    def _key_problems(self) -> str:
        parts = []
        for title, keys in (("missing", self.missing), ("unexpected", self.unexpected),
                            ("shape mismatch", self.shape_mismatches)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8
                                               else "")
                parts.append(f"{title}: {shown}")
        return "; ".join(parts)


class CheckpointError(ValueError):
    """A checkpoint file that does not exist or cannot be read."""


#: Beside a checkpoint ``NAME.pth``, ``NAME.pth.sha256`` holds its SHA-256 in ``sha256sum``
#: format; training snapshots are written with one.
CHECKSUM_SUFFIX = ".sha256"


def checksum_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checkpoint(path: str | Path, what: str = "checkpoint") -> Any:
    """The contents of a checkpoint file, tensors on CPU, loaded with ``weights_only=True`` (no
    code in the file runs). The project's one reader of such files: training snapshots,
    original-package files, weights for ``iabn test`` and ``iabn segment``. ``what`` names the
    file in the :class:`CheckpointError` (``"snapshot"``, ``"checkpoint"``), one line, raised
    also when the checksum file beside it (``NAME.pth.sha256``) records another SHA-256, and
    when a floating-point tensor in it holds a NaN or an infinity (a diverged run's weights,
    or damage that a regenerated checksum hides): training from them or evaluating them would
    only spread it."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(f.name for f in path.glob("*.pth") if f.is_file())[:5]
        hint = (f"give a file in it, e.g. {path / inside[0]} (it has {', '.join(inside)})"
                if inside else "give the checkpoint file (.pth)")
        raise CheckpointError(f"{what} {path} is a folder, not a file: {hint}")
    if not path.exists():
        raise CheckpointError(f"{what} {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is not a regular file")
    checksum = checksum_path(path)
    if checksum.is_file():
        expected = checksum.read_text().split(maxsplit=1)[0] if checksum.stat().st_size else ""
        if file_sha256(path) != expected:
            raise CheckpointError(f"cannot read {what} {path} (corrupt: its SHA-256 does not "
                                  f"match {checksum.name}; a bit flip or a partial copy)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a clear message naming the file, whatever torch raised
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise CheckpointError(f"cannot read {what} {path} (corrupt, truncated or not a torch "
                              f"file): {type(error).__name__}: {first}") from error
    broken = _first_non_finite(payload)
    if broken is not None:
        raise CheckpointError(f"{what} {path} holds a NaN or an infinity in {broken}: it was "
                              f"written by a diverged run or damaged; use an earlier one")
    return payload


def _first_non_finite(value: Any, where: str = "") -> str | None:
    """The place (``['model']['conv.weight']``) of the first floating-point tensor in ``value``
    (dicts, lists and tuples followed) with a NaN or an infinity, or ``None``."""
    if isinstance(value, Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return where or "the tensor"
        return None
    items = (value.items() if isinstance(value, Mapping)
             else enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        found = _first_non_finite(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def _read(checkpoint: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """An already loaded checkpoint as it is, or the file read by :func:`read_checkpoint`."""
    return checkpoint if isinstance(checkpoint, Mapping) else read_checkpoint(checkpoint)


def original_state_dict(checkpoint: Mapping[str, Any] | str | Path,
                        section: str | None = None) -> dict[str, Tensor]:
    """The flat state_dict inside an original checkpoint (a path or an already loaded dict),
    ``module.`` prefixes removed; ``section`` picks ``body``/``head``/``cls`` of a Vistas
    snapshot."""
    checkpoint = _read(checkpoint)
    state = checkpoint.get("state_dict", checkpoint)
    if section is not None:
        if section not in state:
            raise KeyError(f"checkpoint has no section {section!r}; it has {sorted(state)}")
        state = state[section]
    return {k.removeprefix("module."): v for k, v in state.items()}


def abs_into_signed(state: Mapping[str, Any], model: nn.Module) -> list[str]:
    """Names of ``model``'s signed iabn layers whose entry in ``state``'s metadata says
    ``gamma_mode="abs"`` (iabn records it when an abs layer saves its state)."""
    metadata = getattr(state, "_metadata", None) or {}
    modules = dict(model.named_modules())
    return [name.removeprefix("module.") for name, meta in metadata.items()
            if isinstance(meta, Mapping) and meta.get("gamma_mode") == ABS
            and isinstance(modules.get(name.removeprefix("module.")), ABN)
            and modules[name.removeprefix("module.")].gamma_mode != ABS]


def abs_into_signed_note(layers: list[str]) -> str:
    shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
    return (f"{len(layers)} layer(s) ({shown}) get abs-trained weights (|w| + eps) but compute "
            f"with gamma_mode='signed': outputs change; build them with gamma_mode='abs' or "
            f"convert with iabn.compat.to_signed_state_dict")


def resolve_origin(origin: str, checkpoint: Mapping[str, Any] | str | Path,
                   payload: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """``(origin, reason)``: ``origin`` normalised (``"InPlaceABN"``, ``"InPlaceABNSync"``,
    ``"inplace"``, ``"sync"`` -> ``"InPlaceABN"``; ``"ABN"``, ``"standard"``, ``"stdbn"`` ->
    ``"ABN"``), or for ``"auto"`` what the checkpoint says: a ``bn_mode`` entry (top level or
    under ``config``/``config["network"]``, the original's experiment files), else ``stdbn`` in
    the file name (the original's standard-BN runs), else ``"InPlaceABN"``."""
    key = str(origin).replace("_", "").replace("-", "").lower()
    if key not in _ORIGIN_ALIASES:
        raise ValueError(
            f"unknown origin={origin!r}: use 'InPlaceABN' (weights trained with the original "
            f"InPlaceABN/InPlaceABNSync, |w| + eps), 'ABN' (the original's standard ABN, signed "
            f"weights) or 'auto'"
        )
    resolved = _ORIGIN_ALIASES[key]
    if resolved != AUTO:
        return resolved, "given"
    if isinstance(payload, Mapping):
        config = payload.get("config")
        for where, holder in (("checkpoint", payload), ("config", config),
                              ("config.network", config.get("network")
                               if isinstance(config, Mapping) else None)):
            if isinstance(holder, Mapping) and isinstance(holder.get("bn_mode"), str):
                mode = holder["bn_mode"]
                found = _ORIGIN_ALIASES.get(mode.lower())
                if found in (IN_PLACE, STANDARD):
                    return found, f"{where} bn_mode={mode!r}"
    if isinstance(checkpoint, (str, Path)) and "stdbn" in Path(checkpoint).name.lower():
        return STANDARD, "file name contains 'stdbn'"
    return IN_PLACE, "default: no bn_mode in the checkpoint, no 'stdbn' in its name"


def load_original(model: nn.Module, checkpoint: Mapping[str, Any] | str | Path,
                  section: str | None = None, strict: bool = True,
                  origin: str = AUTO) -> LoadReport:
    """Load an original-package checkpoint into ``model`` so that it computes what the
    original did. ``origin`` is the original layer type that trained the weights:

    - ``"InPlaceABN"`` (also its ``InPlaceABNSync``): every iabn norm layer switches to
      ``gamma_mode="abs"``; a plain ``nn.BatchNorm2d`` (``norm_act="bn"``) gets
      ``|weight| + eps`` as its weight instead.
    - ``"ABN"`` (the original's standard batch norm): every iabn norm layer switches to
      ``gamma_mode="signed"``; ``nn.BatchNorm2d`` weights load as they are.
    - ``"auto"`` (default): see :func:`resolve_origin`.

    The report says which origin was used and why, and how each norm layer now computes
    (``report.layers``). Missing ``num_batches_tracked`` entries are filled with 0. With
    ``strict=True`` any other missing, unexpected or mis-shaped key raises a ``ValueError``
    listing them, before the model is touched; with ``strict=False`` the matching keys are
    loaded and the report says what was left out.
    """
    payload = _read(checkpoint)
    resolved, reason = resolve_origin(origin, checkpoint, payload)
    state = original_state_dict(payload, section)
    own = model.state_dict()
    report = LoadReport()
    for key, value in own.items():
        if key not in state:
            if key.endswith("num_batches_tracked"):
                state[key] = torch.zeros_like(value)
            else:
                report.missing.append(key)
        elif tuple(state[key].shape) != tuple(value.shape):
            report.shape_mismatches.append(
                f"{key} {tuple(state[key].shape)} vs {tuple(value.shape)}")
    report.unexpected = [key for key in state if key not in own]
    if strict and not report.ok:
        raise ValueError(f"checkpoint does not fit {type(model).__name__}: {report}")
    usable = {k: v for k, v in state.items()
              if k in own and tuple(v.shape) == tuple(own[k].shape)}
    model.load_state_dict(usable, strict=False)
    report.origin, report.origin_reason = resolved, reason
    for name, module in model.named_modules():
        if isinstance(module, ABN):
            module.gamma_mode = ABS if resolved == IN_PLACE else SIGNED
            report.layers[name] = module.gamma_mode
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            if resolved == IN_PLACE and module.weight is not None:
                with torch.no_grad():
                    module.weight.copy_(module.weight.abs() + module.eps)
                report.layers[name] = "bn |w|+eps"
            else:
                report.layers[name] = "bn"
    if resolved == STANDARD:
        tiny = [name for name, module in model.named_modules()
                if isinstance(module, ABN) and module._in_place and module.weight is not None
                and bool((module.weight.abs() < module.eps).any())]
        if tiny:
            shown = ", ".join(tiny[:3]) + (", ..." if len(tiny) > 3 else "")
            report.warnings.append(
                f"{len(tiny)} in-place layer(s) ({shown}) have |weight| < eps, which "
                f"InPlaceABN clamps to eps (it divides by the scale); use ABN there to compute "
                f"exactly the original ABN")
    return report
