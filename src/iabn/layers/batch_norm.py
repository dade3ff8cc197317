"""Modules mirroring ``torch.nn.BatchNorm*`` and the original ``inplace_abn`` package.

They subclass PyTorch's ``_NormBase``, so parameters, buffers, ``state_dict`` keys,
``reset_parameters()``, ``reset_running_stats()`` and the loading of old checkpoints without
``num_batches_tracked`` are ``nn.BatchNorm2d``'s. They are deliberately *not* ``_BatchNorm``
subclasses: ``nn.SyncBatchNorm.convert_sync_batchnorm`` would replace them with a plain
``SyncBatchNorm`` and drop the activation. Inputs ``(N, C)`` to ``(N, C, D, H, W)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _NormBase

from ..autograd.batch_norm import compute_abn, compute_inplace
from ..autograd.call import check_per_call, input_signature
from ..kernels.activations import WITH_PARAMETER
from ..kernels.common import SIGNED, LayerConfig
from .checks import OverwriteInputOption, check_inputs
from .options import (
    ValidatedOptions,
    check_flag,
    check_loaded_gamma_mode,
    check_num_features,
    check_options,
    note_gamma_mode,
)


class ABN(ValidatedOptions, _NormBase):
    """Batch norm followed by an activation, without the in-place trick.

    Stores its input and output for backward, like ``nn.BatchNorm2d`` + an in-place
    activation; accepts ``relu`` too. Use it where the input must survive the layer
    (e.g. it is a residual branch's input) or is a leaf that requires grad.

    Args:
        num_features: C of an ``(N, C, *spatial)`` input.
        eps, momentum, affine, track_running_stats, device, dtype: as ``nn.BatchNorm2d``
            (``momentum=None`` is a cumulative average).
        activation: a name of :data:`iabn.kernels.activations.ACTIVATIONS` (default
            ``"leaky_relu"``), computed as its ``torch.nn`` module computes it (``"gelu"``:
            the exact, erf form, ``nn.GELU()``).
        activation_param: leaky_relu's negative slope (default 0.01) or elu's alpha.
        gamma_mode: ``"signed"`` (default; ``nn.BatchNorm`` weights load unchanged) or
            ``"abs"`` (``|weight| + eps``, for checkpoints of the original package).
    """

    _in_place = False
    #: Whether backward inverts the activation (so it must be invertible).
    _needs_inverse = False
    #: Whether it keeps a branch bit (so takes the activations with one minimum).
    _branch_bit = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
        *,
        gamma_mode: str = SIGNED,
        bias: bool = True,
    ) -> None:
        check_num_features(num_features)
        check_options(activation, activation_param, gamma_mode, in_place=self._needs_inverse,
                      eps=eps, momentum=momentum, branch=self._branch_bit)
        check_flag("bias", bias)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if not bias:  # as nn.BatchNorm2d(C, bias=False): no bias parameter, none in state_dict
            self.register_parameter("bias", None)
        self.activation = activation
        self.activation_param = float(activation_param)
        self.gamma_mode = gamma_mode

    #: The options a layer reads on every call (ValidatedOptions).
    _OPTIONS = ("num_features", "eps", "momentum", "activation", "activation_param",
                "gamma_mode", "variant")

    def _check_assigned(self, options: dict[str, Any], name: str) -> None:
        if name == "num_features":
            check_num_features(options[name])
            return
        check_options(
            options["activation"], options["activation_param"], options["gamma_mode"],
            in_place=self._needs_inverse,
            variant=2 if options["variant"] is None else options["variant"],
            eps=options["eps"], momentum=options["momentum"], branch=self._branch_bit,
        )

    def _normalisation(self) -> tuple[bool, Tensor | None, Tensor | None]:
        """(use batch statistics?, running_mean, running_var) exactly as ``nn.BatchNorm``."""
        use_batch_stats = self.training or self.running_mean is None
        if self.training and not self.track_running_stats:
            return use_batch_stats, None, None
        return use_batch_stats, self.running_mean, self.running_var

    def _count_batch(self) -> float:
        """Count this batch in ``num_batches_tracked`` (as ``nn.BatchNorm``'s forward does) and
        return the running-statistics factor. A write: call it only once the checks passed,
        so a rejected call leaves the count unchanged. (The layers' own forward counts after
        the computation instead, see :meth:`_prepare`.)"""
        if not (self.training and self.track_running_stats):
            return 0.0
        factor = self._running_factor(self.num_batches_tracked)
        self.num_batches_tracked.add_(1)
        return factor

    def _running_factor(self, counter: Tensor) -> float:
        """The running statistics' update factor of a training step that tracks them:
        ``momentum``, or with ``momentum=None`` the cumulative average's ``1 / n`` over the
        ``counter`` batches seen before plus this one."""
        momentum = self.momentum
        return 1.0 / (float(counter) + 1) if momentum is None else momentum

    def _prepare(self, input: Tensor) -> tuple[
        Tensor | None, Tensor | None, Tensor | None, Tensor | None, LayerConfig, Tensor | None
    ]:
        """Validate a call: ``(weight, bias, running_mean, running_var, config, counter)``,
        the statistics as :meth:`_normalisation` gives them and the momentum as
        :meth:`_count_batch` would. ``counter`` is the ``num_batches_tracked`` the caller
        counts the batch in (``add_(1)``) once the computation has succeeded, as
        ``nn.BatchNorm`` counts it, or ``None``: a call that raises, here or in the kernels
        (``IABN_BACKEND`` is read there), is not counted."""
        try:
            # What self.weight and the others return, read from the tables nn.Module's
            # __getattr__ reads (the attribute costs ~0.5 µs each, as __getattr__ runs only
            # after the normal lookup has failed). nn.Module keeps a registered name out of
            # __dict__ and refuses to register one the class defines, so the tables answer as
            # the attributes do; a name taken out of them (del, parametrize, weight_norm,
            # DataParallel's replicas) is read as an attribute below.
            parameters, buffers = self._parameters, self._buffers
            weight, bias = parameters["weight"], parameters["bias"]
            running_mean, running_var = buffers["running_mean"], buffers["running_var"]
            counter = buffers["num_batches_tracked"]
        except KeyError:
            weight, bias = self.weight, self.bias
            running_mean, running_var = self.running_mean, self.running_var
            tracking = self.training and self.track_running_stats
            counter = self.num_batches_tracked if tracking else None
        training = self.training
        use_batch_stats = training or running_mean is None
        if training and not self.track_running_stats:
            running_mean = running_var = None
        self._check(input, use_batch_stats, running_mean, running_var, weight, bias)
        if training and self.track_running_stats:
            momentum = self.momentum
            if momentum is None:
                momentum = self._running_factor(counter)
        else:
            momentum, counter = 0.0, None
        config = self.__dict__.get("_call_config")
        if config is None or config[0] is not use_batch_stats or config[1] != momentum:
            config = self._layer_config(use_batch_stats, momentum)
        return weight, bias, running_mean, running_var, config, counter

    def _check(
        self, input: Tensor, use_batch_stats: bool, running_mean: Tensor | None,
        running_var: Tensor | None, weight: Tensor | None, bias: Tensor | None,
    ) -> None:
        """Validate a call before anything is written: the full :func:`check_inputs` when its
        :func:`input_signature` differs from the last valid one (first call, new shape,
        ``.to()``, eval/train switch, an option assigned), always the per-tensor checks."""
        check_per_call(input, in_place=self._in_place)
        signature = input_signature(input, use_batch_stats, weight, bias, running_mean,
                                    running_var)
        if signature != self.__dict__.get("_valid_signature"):
            check_inputs(
                input, running_mean, running_var, weight, bias, use_batch_stats,
                in_place=self._in_place, num_features=self.num_features,
            )
            # Set through __dict__: nn.Module.__setattr__ costs a microsecond per call. Not
            # while compiling: the cache is state outside the traced call, which Dynamo
            # refuses to write inside a region it traces as one operation
            # (torch.utils.checkpoint), and compiled code runs no check per call anyway.
            if not torch.compiler.is_compiling():
                self.__dict__["_valid_signature"] = signature

    def _layer_config(self, use_batch_stats: bool, momentum: float) -> LayerConfig:
        """This call's settings, built from the options and kept (``_call_config`` in
        ``__dict__``) for the next calls with the same ``use_batch_stats`` and ``momentum``
        (:meth:`_prepare` compares them; assigning an attribute drops it:
        :class:`ValidatedOptions`)."""
        config = LayerConfig(use_batch_stats, momentum, self.eps, self.activation,
                             self.activation_param, self.gamma_mode,
                             self.__dict__.get("variant", 2))
        if not torch.compiler.is_compiling():  # (see _check)
            self.__dict__["_call_config"] = config
        return config

    def forward(self, input: Tensor) -> Tensor:
        weight, bias, running_mean, running_var, config, counter = self._prepare(input)
        output = self._compute(input, running_mean, running_var, weight, bias, config)
        if counter is not None:
            counter.add_(1)
        return output

    #: The computation after the checks, called as ``(input, running_mean, running_var,
    #: weight, bias, config)``: the out-of-place one here, the in-place one in InPlaceABN.
    _compute = staticmethod(compute_abn)

    def __prepare_scriptable__(self) -> ABN:
        # torch.jit.script calls this on every submodule before compiling: fail here, with the
        # way out, rather than deep inside the compiler on a line of the checks.
        raise RuntimeError(
            f"iabn.{type(self).__name__} cannot be compiled by TorchScript (torch.jit.script): "
            f"its forward is Python that TorchScript cannot compile (input checks, an autograd "
            f"Function). Use torch.compile (it compiles the layer, fullgraph=True included), "
            f"or, to export for inference, a copy of the model with nn.BatchNorm2d + the "
            f"activation in its place (a gamma_mode='signed' layer's state_dict loads into it "
            f"unchanged)"
        )

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        note_gamma_mode(self.gamma_mode, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs) -> None:
        check_loaded_gamma_mode(self.gamma_mode, local_metadata, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, track_running_stats={self.track_running_stats}, "
            f"activation={self.activation}"
        )
        if self.activation in WITH_PARAMETER:
            text += f", activation_param={self.activation_param}"
        if self.gamma_mode != SIGNED:
            text += f", gamma_mode={self.gamma_mode}"
        if self.affine and self.bias is None:
            text += ", bias=False"
        return text


class InPlaceABN(OverwriteInputOption, ABN):
    """In-Place Activated BatchNorm: overwrites its input and stores only its output.

    Same arguments as :class:`ABN` plus ``variant`` (2, the default, or 1: the paper's two
    backward passes) and ``overwrite_input`` (``False``: the output-only mode of
    :class:`OverwriteInputOption`, for an input that is needed again). ``activation`` must be
    invertible (``INVERTIBLE_ACTIVATIONS`` of :mod:`iabn.kernels.activations`: ``"leaky_relu"``,
    ``"elu"``, ``"identity"``) or have one minimum (``BRANCH_ACTIVATIONS``, e.g. ``"silu"``),
    which keep one bit per element saying which of the two inputs of an output it was
    (docs/design.md, "SiLU and GELU in place"). The returned tensor *is* the input tensor, so
    the input must not be needed elsewhere afterwards (e.g. a residual shortcut; the contract:
    docs/usage/layers.md). An input autograd or an engine forbids overwriting (a ``chunk``
    view, FSDP2's, a checkpoint's input) is computed output-only (docs/design.md).
    """

    _in_place = True
    _needs_inverse = True
    _branch_bit = True

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
        *,
        gamma_mode: str = SIGNED,
        variant: int = 2,
        overwrite_input: bool = True,
        bias: bool = True,
    ) -> None:
        check_options(activation, activation_param, gamma_mode, in_place=True, variant=variant,
                      eps=eps, momentum=momentum, branch=self._branch_bit)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device=device, dtype=dtype, gamma_mode=gamma_mode, bias=bias,
        )
        self.variant = variant
        self.overwrite_input = overwrite_input

    def _compute(self, input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                 weight: Tensor | None, bias: Tensor | None, config: LayerConfig) -> Tensor:
        return compute_inplace(input, running_mean, running_var, weight, bias, config,
                               overwrite=self._in_place)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        text += f", variant={self.variant}" if self.variant != 2 else ""
        return text + ("" if self.overwrite_input else ", overwrite_input=False")


