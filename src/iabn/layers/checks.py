"""Input validation shared by the functional forms and the modules.

Every check runs before anything is written, so a rejected call leaves the input and the
running statistics exactly as they were. Messages name the argument and the fix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd.call import check_tensor_kind, check_writable
from ..kernels.common import LOW_PRECISION

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHAPES = "(N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W)"


def check_inputs(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    *,
    in_place: bool,
    num_features: int | None = None,
    synchronised: bool = False,
) -> None:
    """Validate a call; ``training`` means "normalise with batch statistics".

    ``synchronised``: the batch statistics come from all ranks, so this rank may hold a single
    value per channel, or none; the total is checked after the ranks' counts are gathered.
    """
    check_tensor_kind(input)
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"input has dtype {input.dtype}; batch normalisation needs float16, bfloat16, "
            f"float32 or float64: convert it first, e.g. input.float()"
        )
    if not 2 <= input.dim() <= 5:
        raise ValueError(
            f"input must have shape {_SHAPES}; got a {input.dim()}-D tensor of shape "
            f"{tuple(input.shape)}"
        )
    channels = input.shape[1]
    if num_features is not None and channels != num_features:
        raise ValueError(
            f"input has {channels} channels (dim 1) but the layer was built with "
            f"num_features={num_features}: check the preceding layer's output channels"
        )
    for name, t in (
        ("weight", weight), ("bias", bias),
        ("running_mean", running_mean), ("running_var", running_var),
    ):
        check_channel_tensor(name, t, input, channels)
    check_param_dtypes(input, weight, bias, running_mean, running_var)
    if (running_mean is None) != (running_var is None):
        given, missing = (
            ("running_var", "running_mean") if running_mean is None
            else ("running_mean", "running_var")
        )
        raise ValueError(
            f"{missing} is None but {given} is not: pass both running statistics or neither "
            f"(on a layer, set both buffers to None, or use track_running_stats=False)"
        )
    if not training and (running_mean is None or running_var is None):
        raise ValueError(
            "running_mean and running_var are required when training=False (normalising with "
            "running statistics); pass both, or training=True to use the batch statistics"
        )
    if training and not synchronised:
        values_per_channel = input.numel() // max(channels, 1)
        if input.numel() == 0:
            # nn.BatchNorm2d returns an empty output here (and counts the batch); refusing
            # before anything is counted is the clearer of the two (ATen's own error came
            # after num_batches_tracked had advanced)
            raise ValueError(
                f"empty input of shape {tuple(input.shape)} when training: batch statistics "
                f"need at least one value per channel; skip empty batches (e.g. "
                f"drop_last=True), or use eval mode"
            )
        if values_per_channel == 1:
            raise ValueError(
                f"expected more than 1 value per channel when training, got input of shape "
                f"{tuple(input.shape)}: use a batch of at least 2 samples (or spatial size > 1), "
                f"or eval mode"
            )
    if in_place:
        check_writable(input)


def check_param_tensor(name: str, t: Tensor | None, input: Tensor) -> bool:
    """``t`` (a weight or bias) is ``None`` (returns False) or a tensor on the input's device
    (returns True); its shape is the caller's to check."""
    if t is None:
        return False
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != input.device:
        raise ValueError(
            f"{name} is on {t.device} but input is on {input.device}: move the layer with "
            f".to({str(input.device)!r}) (or the input to {t.device})"
        )
    return True


def check_channel_tensor(name: str, t: Tensor | None, input: Tensor, channels: int) -> None:
    if check_param_tensor(name, t, input) and tuple(t.shape) != (channels,):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but input has {channels} channels: "
            f"{name} must have shape ({channels},)"
        )


def check_param_dtypes(input: Tensor, *params: Tensor | None) -> None:
    given = [p for p in params if p is not None]
    dtypes = {p.dtype for p in given}
    if len(dtypes) > 1:
        raise TypeError(
            f"weight, bias and running statistics must share one dtype, got "
            f"{sorted(map(str, dtypes))}: convert them together, e.g. layer.float()"
        )
    if not dtypes:
        return
    (dtype,) = dtypes
    allowed = (input.dtype, torch.float32) if input.dtype in LOW_PRECISION else (input.dtype,)
    if dtype not in allowed:
        hint = (
            "keep parameters in float32 (or the input's dtype) for half-precision inputs"
            if input.dtype in LOW_PRECISION
            else f"convert the layer with .to({input.dtype}) or the input with .to({dtype})"
        )
        raise TypeError(f"parameters have dtype {dtype} but input has {input.dtype}: {hint}")


def check_overwrite_input(value: object) -> None:
    """The in-place layers' ``overwrite_input``: a bool, whose two meanings the message says."""
    if not isinstance(value, bool):
        raise TypeError(
            f"overwrite_input={value!r}: must be True (overwrite the input, the default) or "
            f"False (write a new tensor and keep only it for backward)"
        )


class OverwriteInputOption:
    """The ``overwrite_input`` option of the in-place layers (:class:`InPlaceABN`,
    :class:`iabn.InPlaceABNSync`, :class:`iabn.InPlaceGroupNormAct`).

    ``True`` (default): the layer overwrites its input and returns it (an input autograd or
    an engine forbids overwriting, e.g. a ``chunk`` or FSDP2 view, is computed as with
    ``False``: the run-time rule, docs/design.md). ``False`` (the output-only mode): the
    layer leaves its input untouched and runs on a copy, which it returns; it keeps only that
    output for backward, so its input is freed once nothing else holds it (a residual stream
    read again by an addition, a tensor feeding two branches), where :class:`ABN` keeps both.
    The copy costs one more pass in forward (read and write); the input checks are those of a
    layer that does not overwrite (a leaf that requires grad is accepted)."""

    @property
    def overwrite_input(self) -> bool:
        # stored as the instance's _in_place, which the input checks read (the class
        # attribute stays True: iabn.debug names the in-place layer classes by it)
        return self.__dict__.get("_in_place", True)

    @overwrite_input.setter
    def overwrite_input(self, value: bool) -> None:
        check_overwrite_input(value)
        self.__dict__["_in_place"] = value
        self.__dict__.pop("_valid_signature", None)  # the checks differ between the modes
