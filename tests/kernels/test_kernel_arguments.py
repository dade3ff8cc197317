"""Every Python float a launch passes to a Triton kernel reaches a ``tl.float64`` parameter.

Triton types an unannotated float argument as float32 on a GPU, while its CPU interpreter keeps
the Python float: a float64 layer then matched PyTorch on CPU and missed it on an H100 (momentum
0.1 rounded to float32 put the running statistics 1.5e-8 off, eps 1e-5 the outputs 1e-13). So
the launches are recorded here, on whatever device the kernels run, and every float argument's
parameter must be annotated float64 (tests/kernels/test_triton.py checks the compiled PTX)."""

from __future__ import annotations

import inspect

import pytest
import torch

import iabn
from iabn.kernels.backends import use_backend

from helpers import BRANCH, TRITON_DEVICE, runs_triton

triton_kernels = pytest.importorskip("iabn.kernels.triton_kernels")


def _record_float_arguments(seen: dict[tuple[str, str], str]):
    """Wrap every kernel's ``run``; returns the function that unwraps them."""
    wrapped = []
    for name in triton_kernels.TRAFFIC:
        kernel = getattr(triton_kernels, name)
        original = type(kernel).run.__get__(kernel)
        parameters = inspect.signature(kernel.fn).parameters

        def run(*args, grid, warmup, _name=name, _kernel=kernel, _original=original,
                _parameters=parameters, **kwargs):
            values = dict(zip(_kernel.arg_names, args, strict=False))
            values.update(kwargs)
            for arg, value in values.items():
                if isinstance(value, float):
                    seen[_name, arg] = str(_parameters[arg].annotation)
            return _original(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = run
        wrapped.append(kernel)

    def unwrap():
        for kernel in wrapped:
            kernel.__dict__.pop("run", None)

    return unwrap


@runs_triton
@pytest.mark.slow  # 9 s on 2 cores: every kernel under the interpreter
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.1), ("elu", 0.7),
                                              ("identity", 0.01),
                                              *((name, 0.01) for name in BRANCH)])
def test_every_float_argument_is_a_float64_parameter(activation, param):
    seen: dict[tuple[str, str], str] = {}
    unwrap = _record_float_arguments(seen)
    try:
        layer = iabn.InPlaceABN(5, activation=activation, activation_param=param,
                                momentum=0.1).double().to(TRITON_DEVICE)
        with use_backend("triton"):
            for training in (True, False):
                layer.train(training)
                x = torch.randn(3, 5, 4, 6, dtype=torch.float64, device=TRITON_DEVICE)
                x.requires_grad_()
                layer(x.clone()).sum().backward()
    finally:
        unwrap()
    # the forward (momentum, eps) and the backward (count; slope and tiny for the recovering
    # activations) pass floats
    assert ("finalize_forward_kernel", "momentum") in seen
    assert ("finalize_backward_kernel", "count") in seen
    wrong = {key: annotation for key, annotation in seen.items() if "float64" not in annotation}
    assert not wrong, f"float arguments of parameters not annotated tl.float64: {wrong}"
