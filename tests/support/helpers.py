"""Shared pieces of the tests: the machine they run on (see conftest.py) and the independent
references built from ``torch.nn``."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

#: CUDA is visible to this process.
HAS_CUDA = torch.cuda.is_available()
#: The Triton kernels run under the CPU interpreter in this process: always without CUDA,
#: and with CUDA when ``IABN_TEST_INTERPRET=1`` asks for it.
INTERPRET = not HAS_CUDA or os.environ.get("IABN_TEST_INTERPRET", "0") not in ("", "0")
#: Where tests of the Triton kernels put their tensors.
TRITON_DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def load_script(path: Path) -> ModuleType:
    """Import a benchmark script (not a package module) as the module named after its file,
    freshly executed. It is registered in ``sys.modules`` first, where dataclasses look their
    module up."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def one_line_error(capsys, command: str) -> str:
    """What a tool printed on stderr for a user error: one line ``iabn COMMAND: error: ...``
    and no traceback (asserted); returned for the caller's own checks."""
    err = capsys.readouterr().err
    assert err.startswith(f"iabn {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def runs_triton(test):
    """Mark a test of the Triton kernels (on ``TRITON_DEVICE``): where they are compiled for
    CUDA it is a ``gpu`` test."""
    return pytest.mark.gpu(test) if TRITON_DEVICE.type == "cuda" else test

# ------------------------------------------------------------------ activations
# Every list of activations the tests parametrise over comes from iabn's registry, so that a
# new activation is tested wherever its kind is; the references stay torch's own modules.


def activation_names(*, invertible: bool | None = None, branch: bool | None = None,
                     with_parameter: bool | None = None) -> list[str]:
    """The registry's activations of the given kinds (``None``: either), in its order."""
    from iabn.kernels.activations import ACTIVATIONS

    return [
        name for name, a in ACTIVATIONS.items()
        if (invertible is None or a.invertible == invertible)
        and (branch is None or a.needs_branch == branch)
        and (with_parameter is None or (a.parameter is not None) == with_parameter)
    ]


#: The activations the in-place layer inverts from the output alone.
INVERTIBLE = activation_names(invertible=True)
#: The activations the in-place batch-norm layer inverts with a branch bit (one minimum).
BRANCH = activation_names(branch=True)
#: The activations with a parameter (``activation_param``).
WITH_PARAMETER = activation_names(with_parameter=True)
#: The parameter values the tests use, by the torch keyword that names them (not torch's
#: defaults, which a bug ignoring the value would still pass with).
PARAMETER_VALUES = {"negative_slope": 0.1, "alpha": 0.7, "beta": 1.5}


def param_for(name: str) -> float:
    """The ``activation_param`` the tests give ``name`` (0.0 without a parameter)."""
    from iabn.kernels.activations import ACTIVATIONS

    parameter = ACTIVATIONS[name].parameter
    return PARAMETER_VALUES[parameter.keyword] if parameter is not None else 0.0


ACTIVATION_PARAMS = {name: param_for(name) for name in activation_names()}


def torch_activation(name: str, param: float = 0.0) -> nn.Module:
    """The ``torch.nn`` module matching an iabn activation (the reference)."""
    from iabn.kernels.activations import ACTIVATIONS

    return ACTIVATIONS[name].torch_module(param)


@functools.cache
def torch_minimum(name: str) -> float:
    """``y*`` where the derivative of torch's own module of ``name`` vanishes, by float64
    bisection of its sign on [-3, 0] (independent of iabn's constants)."""
    module = torch_activation(name)
    slope = torch.func.grad(lambda y: module(y))
    lo, hi = torch.tensor(-3.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    assert slope(lo) < 0 < slope(hi), name
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slope(mid) < 0 else (lo, mid)
    return ((lo + hi) / 2).item()


def exact_inverse(z: torch.Tensor, left: torch.Tensor, name: str,
                  lowest: float = -120.0) -> torch.Tensor:
    """float64 ``y`` with ``phi(y) = z`` for torch's own module of ``name`` in float64, on the
    branch ``left`` names (``y < y*``; the left one searched down to ``lowest``): 200
    bisections, independent of iabn's inversion."""
    act, y_star = torch_activation(name), torch_minimum(name)
    z = z.double()
    lo = torch.where(left, torch.full_like(z, lowest), torch.full_like(z, y_star))
    hi = torch.where(left, torch.full_like(z, y_star), z.clamp(min=0) * 2 + 1)
    for _ in range(200):
        mid = (lo + hi) / 2
        go_right = torch.where(left, act(mid) > z, act(mid) < z)
        lo, hi = torch.where(go_right, mid, lo), torch.where(go_right, hi, mid)
    return (lo + hi) / 2


def torch_batchnorm(ndim: int, channels: int, **kw) -> nn.Module:
    """``nn.BatchNorm1d/2d/3d`` for an input of ``ndim`` dims."""
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]
    return cls(channels, **kw)


def randomise_(bn: nn.Module) -> nn.Module:
    """Non-trivial parameters and statistics, gamma of both signs and away from zero."""
    with torch.no_grad():
        if bn.weight is not None:
            magnitude = torch.rand_like(bn.weight) + 0.5
            sign = torch.where(torch.rand_like(bn.weight) < 0.3, -1.0, 1.0).to(bn.weight.dtype)
            bn.weight.copy_(magnitude * sign)
            bn.bias.normal_()
        if bn.running_mean is not None:
            bn.running_mean.normal_(0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return bn


def memory_format_for(ndim: int, channels_last: bool) -> torch.memory_format:
    if not channels_last:
        return torch.contiguous_format
    return {4: torch.channels_last, 5: torch.channels_last_3d}[ndim]


#: Key and shape lists of the original package's released checkpoints (see its README).
ORIGINAL_KEYS = Path(__file__).resolve().parent / "data" / "original_keys"


def reference_layout(path, section=None):
    """``{key without 'module.': shape}`` from a key file of the original package (only the
    ``## state_dict["<section>"]`` part when ``section`` is given)."""
    layout, inside = {}, section is None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            inside = section is not None and f'"{section}"' in line
            continue
        if inside and line and not line.startswith("#"):
            key, shape = line.split(None, 1)
            layout[key.removeprefix("module.")] = tuple(int(d) for d in shape.strip("[]").split(",")
                                                        if d.strip())
    return layout
