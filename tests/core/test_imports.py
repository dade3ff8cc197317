"""The library core needs torch alone: `import iabn` and a training step of its layers work
where numpy, Numba, Pillow, torchvision and the other tools' packages are missing
(pyproject.toml declares numpy for the tools and Numba for the CPU loops only in that sense).
`import torch` itself imports numpy when it is installed, so the check blocks those modules
in a fresh interpreter instead of looking at sys.modules."""

import subprocess
import sys

import pytest

TOOLS_ONLY = ("numpy", "PIL", "torchvision", "sklearn", "tensorboard", "timm", "numba")

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
# an activation with one minimum: Numba's CPU loops missing, ATen's operations instead
x = torch.randn(3, 40, requires_grad=True)
iabn.InPlaceGELU()(x * 1).sum().backward()
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
from iabn.tools.cli import main
sys.exit(main(["bench", "--help"]))
"""


def test_the_main_job_needs_no_tool_packages():
    """``iabn bench``, the README's main job, runs where Pillow, torchvision, scikit-learn,
    TensorBoard and timm are missing: building the CLI's parser imports none of them."""
    result = subprocess.run([sys.executable, "-c", BENCH_SCRIPT], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: iabn bench" in result.stdout


def test_conversion_loads_on_first_use():
    script = ("import sys, iabn; assert 'iabn.conversion' not in sys.modules; "
              "assert iabn.convert is sys.modules['iabn.conversion'].convert; print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.slow
def test_plan_loads_on_first_use():
    """iabn.plan (and SciPy, its solver) load when used, not with `import iabn`."""
    script = ("import sys, iabn; assert 'iabn.planning' not in sys.modules; "
              "assert 'scipy' not in sys.modules; "
              "assert iabn.plan is sys.modules['iabn.planning'].plan; "
              "assert iabn.PlanReport is sys.modules['iabn.planning'].PlanReport; print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.slow
def test_compat_and_models_are_reachable_after_import_iabn():
    """``iabn.compat.to_signed_state_dict`` and ``iabn.models.create``, as the documentation
    (docs/usage/conversion.md, models.md) writes them, work after ``import iabn`` alone; they
    load on first use, and loading iabn.compat registers no ``inplace_abn`` alias (only
    iabn.compat.enable or install() does)."""
    script = ("import sys, iabn; assert 'iabn.compat' not in sys.modules; "
              "assert 'iabn.models' not in sys.modules; "
              "assert iabn.compat.to_signed_state_dict is "
              "sys.modules['iabn.compat'].to_signed_state_dict; "
              "assert iabn.models.create is sys.modules['iabn.models'].create; "
              "assert 'inplace_abn' not in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def _import_graph():
    """iabn's modules and the iabn modules each imports (top-level and inside functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "iabn"
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("iabn", *parts[:-1])) if parts[-1] == "__init__" else ".".join(
            ("iabn", *parts))
        files[name] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (
                    node.module or "")
                for alias in node.names:
                    imports.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in files
                                else target)
            elif isinstance(node, ast.Import):
                imports.update(alias.name for alias in node.names)
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def test_no_import_cycles():
    """No module of iabn imports one that imports it back, directly or through others, even
    lazily inside a function (a layering one can read from the imports)."""
    graph = _import_graph()
    assert "iabn.functional" in graph and "iabn.distributed.function" in graph["iabn.functional"]
    cycles = []

    def visit(name, path, done):
        for target in graph[name]:
            if target in path:
                cycles.append([*path[path.index(target):], target])
            elif target not in done:
                visit(target, [*path, target], done)
        done.add(name)

    done = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert not cycles, cycles[:5]


def _design_layers():
    """docs/design.md's table "Layers of the code": iabn module or package -> (rank, layer),
    rank 0 the lowest. The tools' row names its package first (`tools/`: its parts)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = text.split("## Layers of the code", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| layer |")]
    layers = {}
    for rank, row in enumerate(rows):
        layer, modules = (cell.strip() for cell in row.strip("|").split("|")[:2])
        for entry in re.findall(r"`([^`]+)`", modules.split(":")[0]):
            name = entry.removesuffix(".py").removesuffix("/").replace("/", ".")
            layers[f"iabn.{name}"] = (rank, layer)
    return layers


def test_layers_import_only_layers_listed_before_them():
    """docs/design.md's claim, checked on the code: every module of iabn is in the table of
    layers (but the package itself and ``__main__``), and no
    import, not even one inside a function, reaches a layer listed after the importer's."""
    layers = _design_layers()
    assert layers["iabn.kernels"][0] == 0 and layers["iabn.tools"][1] == "tools"

    def layer_of(module):
        owner = max((name for name in layers
                     if module == name or module.startswith(f"{name}.")), key=len, default=None)
        return layers.get(owner)

    graph = _import_graph()
    unlisted = sorted(m for m in graph if layer_of(m) is None)
    assert unlisted == ["iabn", "iabn.__main__"], unlisted
    upward = [f"{name} ({layer_of(name)[1]}) imports {target} ({layer_of(target)[1]})"
              for name, targets in sorted(graph.items()) if layer_of(name)
              for target in sorted(targets)
              if layer_of(target) and layer_of(target)[0] > layer_of(name)[0]]
    assert not upward, upward


def test_core_imports_no_tool():
    """The tools (iabn.tools) depend on the core, never the reverse: no module outside
    iabn.tools imports one inside it, even lazily. The exception: iabn.__main__, the
    command's entry point (``python -m iabn``)."""
    graph = _import_graph()
    assert "iabn.tools.cli" in graph["iabn.__main__"]  # the graph sees these imports
    allowed = {"iabn.__main__"}

    def is_tool(module):
        return module == "iabn.tools" or module.startswith("iabn.tools.")

    leaks = {name: sorted(filter(is_tool, targets)) for name, targets in graph.items()
             if not is_tool(name) and name not in allowed and any(map(is_tool, targets))}
    assert not leaks, leaks
