"""Which of the library's source files one training step of each layer kind runs code in
(docs/design.md, "The rooms of a training step"): the layer's module, its family's ``Function``,
the one call sequence, the family's math, the activation registry and the backend choice, and
no more. A check of the structure: a step that starts entering a new file (a second call
path, a helper shelf) fails here with the file's name."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import iabn
from iabn.kernels import cpu_loops

SOURCE = Path(iabn.__file__).parent

ABN = {"layers/batch_norm.py", "autograd/batch_norm.py", "autograd/call.py",
       "kernels/batch_norm.py", "kernels/activations.py", "kernels/backends.py",
       "kernels/common.py"}
GROUP = {"layers/group_norm.py", "autograd/group_norm.py", "autograd/call.py",
         "kernels/group_norm.py", "kernels/activations.py", "kernels/backends.py",
         "kernels/common.py"}
ROW = {"layers/layer_norm.py", "layers/checks.py", "autograd/row_norm.py", "autograd/call.py",
       "kernels/row_norm.py", "kernels/backends.py"}
ACTIVATION = {"layers/activation.py", "autograd/activation.py", "autograd/call.py",
              "kernels/activations.py", "kernels/branch.py", "kernels/backends.py",
              "kernels/common.py"}
#: the CPU loops: the branch bits of an activation with one minimum packed, and its backward,
#: and the row norms' backward (kernels/cpu_loops.py, entered where Numba is missing too: it
#: says so; kernels/numba_loops.py, the compiled loops, where it is installed)
LOOPS = {"kernels/cpu_loops.py"} | ({"kernels/numba_loops.py"} if cpu_loops.available() else set())
#: the activations' slopes where the CPU has AVX-512 (alone, and in the norm layers'
#: recovery): the 16-lane loop over the slope tables
VECTOR = ({"kernels/vector_loops.py"}
          if cpu_loops.available() and cpu_loops.vector_loop_runs() else set())
#: batch norm with an activation of one minimum: the branch bits and the inversion, too
ABN_BRANCH = ABN | {"kernels/branch.py"} | LOOPS | VECTOR
#: batch norm with leaky_relu on a CPU input of scratch.MIN_BYTES or more: the backward's
#: reused temporaries
ABN_LARGE = ABN | {"kernels/scratch.py"}


def entered(layer: torch.nn.Module, shape: tuple[int, ...]) -> set[str]:
    """The files under src/iabn whose functions run in one forward + backward of ``layer``
    (after a first step, which may build caches)."""
    leaf = torch.randn(shape, requires_grad=True)
    layer(leaf.clone()).sum().backward()
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(SOURCE):
                seen.add(path.relative_to(SOURCE).as_posix())

    sys.setprofile(profile)
    threading.setprofile(profile)  # autograd's engine may run backward on another thread
    try:
        layer(leaf.clone()).sum().backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


SMALL, LARGE = (2, 16, 4, 4), (8, 16, 32, 32)  # LARGE: 512 KiB, over scratch.MIN_BYTES
CASES = [
    # leaky_relu's inverse and slope write into the reused buffers (its record's writes_out)
    ("InPlaceABN leaky_relu small", lambda: iabn.InPlaceABN(16), SMALL, ABN),
    ("InPlaceABN leaky_relu large", lambda: iabn.InPlaceABN(16), LARGE, ABN_LARGE),
    *[(f"InPlaceABN {a} {s}", lambda a=a: iabn.InPlaceABN(16, activation=a), shape, ABN)
      for a in ("elu", "identity", "softplus")
      for s, shape in (("small", SMALL), ("large", LARGE))],
    *[(f"InPlaceABN {a} {s}", lambda a=a: iabn.InPlaceABN(16, activation=a), shape, ABN_BRANCH)
      for a in ("silu", "gelu", "gelu_tanh", "mish")
      for s, shape in (("small", SMALL), ("large", LARGE))],
    *[(f"InPlaceGroupNormAct {a} {s}",
       lambda a=a: iabn.InPlaceGroupNormAct(4, 16, activation=a), shape, GROUP)
      for a in ("leaky_relu", "elu", "identity", "softplus")
      for s, shape in (("small", SMALL), ("large", LARGE))],
]


@pytest.mark.parametrize(("name", "make", "shape", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_a_norm_act_step_enters_its_rooms_only(name, make, shape, expected):
    assert entered(make(), shape) == expected


@pytest.mark.parametrize("make", [lambda: iabn.InPlaceLayerNorm(16),
                                  lambda: iabn.InPlaceRMSNorm(16)], ids=["layer", "rms"])
def test_a_row_norm_step_enters_its_rooms_only(make):
    assert entered(make(), (4, 5, 16)) == ROW | LOOPS


@pytest.mark.parametrize(("make", "expected"), [
    (iabn.InPlaceGELU, ACTIVATION | LOOPS | VECTOR),
    (iabn.InPlaceSiLU, ACTIVATION | LOOPS | VECTOR),
    (iabn.InPlaceMish, ACTIVATION | LOOPS | VECTOR), (iabn.InPlaceSoftplus, ACTIVATION)])
def test_an_activation_step_enters_its_rooms_only(make, expected):
    assert entered(make(), (4, 5, 16)) == expected
