"""The library core needs torch alone: `import iabn` and a training step of its layers work
where numpy, Pillow, torchvision and the other tools' packages are missing (pyproject.toml
declares numpy for the tools only in that sense). `import torch` itself imports numpy when it is
installed, so the check blocks those modules in a fresh interpreter instead of looking at
sys.modules."""

import subprocess
import sys

TOOLS_ONLY = ("numpy", "PIL", "torchvision", "sklearn", "tensorboard", "timm")

SCRIPT = f"""
import sys
for name in {TOOLS_ONLY!r}:
    sys.modules[name] = None  # any import of it raises ImportError
import warnings
warnings.simplefilter("ignore")  # torch: "Failed to initialize NumPy"
import torch
import iabn

layer = iabn.InPlaceABN(4)
x = torch.randn(3, 4, 5, 5, requires_grad=True)
layer(x.clone()).sum().backward()
assert x.grad is not None and torch.isfinite(x.grad).all()
print("ok")
"""


def test_core_imports_and_trains_with_torch_alone():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


BENCH_SCRIPT = f"""
import sys
for name in {TOOLS_ONLY[1:]!r}:
    sys.modules[name] = None
from iabn.cli import main
sys.exit(main(["bench", "--help"]))
"""


def test_the_main_job_needs_no_tool_packages():
    """``iabn bench``, the README's main job, runs where Pillow, torchvision, scikit-learn,
    TensorBoard and timm are missing: building the CLI's parser imports none of them."""
    result = subprocess.run([sys.executable, "-c", BENCH_SCRIPT], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: iabn bench" in result.stdout
