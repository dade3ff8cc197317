"""Input validation shared by the functional forms and the modules.

Every check runs before anything is written, so a rejected call leaves the input and the
running statistics exactly as they were. Messages name the argument and the fix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd.call import engine_made
from ..kernels.common import LOW_PRECISION

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHAPES = "(N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W)"
_STRIDED = torch.strided


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


def input_signature(
    input: Tensor, training: bool, weight: Tensor | None, bias: Tensor | None,
    running_mean: Tensor | None, running_var: Tensor | None,
) -> tuple:
    """Everything :func:`check_inputs`' verdict depends on except what :func:`check_per_call`
    checks: the input's shape, dtype and device, ``training``, and each per-channel tensor's
    shape, dtype and device (``None`` where absent).

    A module keeps the signature of its last validated call and revalidates only when it
    changes, so a steady training loop pays for building this tuple (about 1 µs), not for the
    whole validation (about 3 µs on CPU). ``input`` must be a tensor (check that first).
    Spelled out, without a loop or helper: it runs on every layer call.
    """
    return (
        input.shape, input.dtype, input.device, training,
        None if weight is None else (weight.shape, weight.dtype, weight.device),
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        None if running_mean is None
        else (running_mean.shape, running_mean.dtype, running_mean.device),
        None if running_var is None
        else (running_var.shape, running_var.dtype, running_var.device),
    )


def check_per_call(input: Tensor, *, in_place: bool) -> None:
    """The checks a cached :func:`input_signature` cannot stand for: the tensor's kind (its
    layout is not in the signature, and a nested tensor has no shape to build one) and
    whether this particular tensor may be overwritten (autograd leaf, memory overlap,
    inference tensor)."""
    # The common case in one test; any failure goes through the full check, which names it.
    if not isinstance(input, Tensor) or input.is_nested or input.layout is not _STRIDED:
        check_tensor_kind(input)
    if in_place:
        check_writable(input)


def check_tensor_kind(input: Tensor) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.is_nested:
        raise TypeError(
            "input is a nested tensor; batch normalisation takes dense (strided) tensors: "
            "pass torch.nested.to_padded_tensor(input, 0.0), or each of its tensors"
        )
    if input.layout is not torch.strided:
        raise TypeError(
            f"input is a {input.layout} tensor; batch normalisation takes dense (strided) "
            f"tensors: pass input.to_dense()"
        )


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


def check_writable(input: Tensor, layer: str = "",
                   instead: str = "the non-in-place iabn.ABN") -> None:
    """The in-place layer overwrites ``input``: reject tensors autograd or memory forbid.
    ``layer``: a prefix naming the layer in the messages; ``instead``: what to use instead."""
    # Neither query below can be traced by torch.compile: they run in eager mode only (inside
    # a compiled graph, layer inputs are the graph's own intermediates).
    eager = not torch.compiler.is_compiling()
    prefix = f"{layer}: " if layer else ""
    if eager and input.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{prefix}input is an inference tensor (made under torch.inference_mode()), which "
            f"cannot be overwritten outside inference mode: run the layer under "
            f"torch.inference_mode() too, pass input.clone(), or use {instead}"
        )
    if torch.is_grad_enabled():
        base = input._base
        leaf = input if base is None else base
        if leaf.is_leaf and leaf.requires_grad and not (eager and engine_made(input, base)):
            what = "a leaf tensor" if leaf is input else "a view of a leaf tensor"
            functional = " (iabn.functional.abn)" if instead.endswith("iabn.ABN") else ""
            raise RuntimeError(
                f"{prefix}input is {what} that requires grad; an in-place layer overwrites its "
                f"input, and autograd cannot differentiate with respect to an overwritten "
                f"leaf. Use {instead}{functional}, or pass a computed tensor (e.g. the output "
                f"of a convolution, or input.clone())"
            )
    # torch.func's wrapped tensors (vmap's batched ones) have no overlap query: there the
    # layer is computed by composition and ATen's copy_ into the input does its own check.
    # A contiguous tensor cannot overlap: asking that first spares the common case the
    # overlap query (0.09 against 0.5 µs, CPU). (_peek_interpreter_stack: torch.func runs.)
    if (eager and _peek_interpreter_stack() is None and not input.is_contiguous()
            and has_internal_overlap(input)):
        raise ValueError(
            f"{prefix}input has elements that share memory (e.g. a tensor made by expand() or "
            f"as_strided()), so it cannot be overwritten in place: pass input.contiguous(), "
            f"or use {instead}"
        )


_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack


# torch._debug_has_internal_overlap's verdicts (ATen's MemOverlap)
_OVERLAP_NO, _OVERLAP_YES, _OVERLAP_TOO_HARD = 0, 1, 2


def has_internal_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` share a memory location.

    ATen answers at once for dense tensors (no) and for a zero stride (yes), and "too hard" for
    the rest, where its own in-place operators go ahead and write. Here "too hard" is settled:
    first by a sufficient condition (each stride, in increasing order, steps past the extent of
    the smaller ones: true of every slice of a dense tensor), and only for tensors that fail
    it, exactly, by comparing the storage offsets of all elements.
    """
    verdict = torch._debug_has_internal_overlap(t)
    if verdict != _OVERLAP_TOO_HARD:
        return verdict == _OVERLAP_YES
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1)
    extent = 0  # the largest offset the dimensions of smaller stride reach
    for stride, size in dims:
        if stride <= extent:
            break
        extent += stride * (size - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        index = torch.arange(size, dtype=torch.int64) * stride
        offsets = offsets + index.reshape((size,) + (1,) * (t.dim() - dim - 1))
    return int(torch.unique(offsets).numel()) < t.numel()


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

    def _to_overwrite(self, input: Tensor) -> Tensor:
        """The tensor the layer overwrites: ``input``, or a copy of it in output-only mode."""
        return input if self._in_place else input.clone()

