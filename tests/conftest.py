"""Where the tests run: the same suite on a machine with CUDA and on one without.

Three kinds of test, told apart by markers (registered in pyproject.toml):

- unmarked: independent of the machine; they run in this process everywhere.
- ``gpu``: runs real CUDA code (``-m gpu`` selects them all); skipped without CUDA. The
  ``backend`` fixture below makes every kernel test one: on a CUDA machine its ``triton`` case
  runs the compiled kernels on CUDA tensors, and its ``reference-cuda`` case PyTorch's CUDA
  kernels, which ``auto`` uses on CUDA by default.
- ``without_gpu``: models a machine without CUDA (the tools pick CUDA when they see one, the
  offloader copies only device memory). Where CUDA is visible they are skipped here and
  ``tests/core/test_machines.py`` runs them in a subprocess with ``CUDA_VISIBLE_DEVICES=``.

Without CUDA the Triton kernels run under Triton's CPU interpreter. With CUDA they are compiled
for the GPU, unless ``IABN_TEST_INTERPRET=1`` asks for the interpreter there too (the
interpreter tests on CPU tensors, as CI runs them; the interpreter then also takes the Triton
code that ``torch.compile`` generates for CUDA, so run ``-m "not gpu"`` with it). Triton reads
``TRITON_INTERPRET`` when a kernel is defined, so it is set here, before anything imports
iabn's kernels.
"""

import os

import pytest
import torch

import triton_interpreter
from helpers import HAS_CUDA, INTERPRET, TRITON_DEVICE

# One intra-op thread per test process unless OMP_NUM_THREADS says otherwise: the tests run
# tiny tensors, on which a second OpenMP thread costs more in synchronisation than it computes
# (tests/core/test_gradcheck.py on the 2-core machine: 50 s with 2 threads, 9.5 s with 1). The
# variable is inherited by the tools the tests start as subprocesses.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
    triton_interpreter.install()
if HAS_CUDA:
    # The tests compare against float32/float64 references: no TensorFloat-32 convolutions
    # or matrix products (cuDNN's default) in the models they train.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

NEEDS_CUDA = "needs a CUDA device (selected with -m gpu)"
MODELS_NO_GPU = ("models a machine without CUDA: tests/core/test_machines.py runs it in a "
                 "subprocess with CUDA_VISIBLE_DEVICES=")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=NEEDS_CUDA))
        if "without_gpu" in item.keywords and HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=MODELS_NO_GPU))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


#: What the planner's in-place recovery timing (iabn.planning.recovery.pair_seconds) answers in
#: the tests: 20 us for each converted layer against the layer it replaced. The planner times
#: those pairs on the machine it runs on, and a timing taken while other jobs load the cores
#: would move its choices between in place and recomputing; a test decides from this fixed
#: figure instead (tests marked measured_recovery time for real).
FIXED_RECOVERY_S = 20e-6


@pytest.fixture(autouse=True)
def _fixed_recovery(request):
    # its own MonkeyPatch, not the test's: an autouse fixture asking for `monkeypatch` would
    # make it outlive tmp_path, whose removal then runs under the test's own patches
    if request.node.get_closest_marker("measured_recovery") is not None:
        yield
        return
    from iabn.planning import recovery

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recovery, "pair_seconds", lambda *args, **kwargs: FIXED_RECOVERY_S)
        yield


_GPU = pytest.mark.gpu
_BACKENDS = [
    pytest.param(("reference", "cpu"), id="reference"),
    # Under the CPU interpreter a Triton case takes many times its reference case: slow (the
    # README's command leaves them out, CI runs them with -m slow); on CUDA, compiled: gpu.
    pytest.param(("triton", TRITON_DEVICE.type), id="triton",
                 marks=(pytest.mark.slow,) if INTERPRET else (_GPU,)),
    pytest.param(("reference", "cuda"), id="reference-cuda", marks=(_GPU,)),
]


@pytest.fixture(params=_BACKENDS)
def _kernels(request, monkeypatch):
    name, device = request.param
    if name == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("IABN_BACKEND", name)
    return name, device


@pytest.fixture
def backend(_kernels):
    """Run the test once per kernel backend (``IABN_BACKEND``): ``reference`` on CPU,
    ``triton`` (interpreted on CPU, compiled on CUDA) and ``reference`` on CUDA. Tests that
    take it build their tensors and modules on ``device``."""
    return _kernels[0]


@pytest.fixture
def device(_kernels):
    """The device of this ``backend`` case: ``torch.device("cpu")`` or ``("cuda")``."""
    return torch.device(_kernels[1])
