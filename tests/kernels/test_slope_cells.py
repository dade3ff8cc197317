"""The slope tables of the CPU's vector loop (``iabn.kernels.slope_cells``) and the loop that
reads them (``iabn.kernels.vector_loops``): the tables are the fitting script's recorded fit,
the fit is what the script makes, and the loop computes what the script's float32 model of it
computes, bit for bit. Its accuracy against float64 torch is tested with the other CPU paths
(``tests/core/test_fitted_slopes.py``, ``tests/kernels/test_cpu_loops.py``)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from iabn.kernels import branch, cpu_loops
from iabn.kernels.slope_cells import TABLES

from helpers import BRANCH, torch_activation

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((ROOT / "benchmarks/results/fit_slope_cells.json").read_text())


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fit_slope_cells
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return fit_slope_cells


def test_tables_are_the_recorded_fit():
    fits = {fitted["name"]: fitted for fitted in RECORDED["fits"]}
    assert set(fits) == set(TABLES) == set(BRANCH)
    for name, (constants, cells) in TABLES.items():
        assert constants == fits[name]["constants"]
        assert constants["right_cells"] + constants["near_cells"] + constants["far_cells"] == 32
        recorded = [[float(np.float32(a)) for a in cell] for cell in fits[name]["cells"]]
        assert [list(cell) for cell in cells] == recorded
        assert len(cells) == 32 and {len(cell) for cell in cells} == {RECORDED["degree"] + 1}


@pytest.mark.slow
def test_the_script_makes_the_recorded_fit():
    """SiLU's fit again (about 2 s): the same cells, within least squares' rounding."""
    fitted = _script().fit("silu", RECORDED["degree"])
    recorded = next(f for f in RECORDED["fits"] if f["name"] == "silu")
    assert fitted["constants"] == recorded["constants"]
    got, want = np.array(fitted["cells"]), np.array(recorded["cells"])
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.skipif(not cpu_loops.available(), reason="Numba is not installed")
@pytest.mark.parametrize("name", BRANCH)
def test_vector_loop_computes_the_scripts_float32_model(name, monkeypatch):
    """Outputs of both branches (``3 randn`` and the left tail down to 1e-3 .. 30 below y*):
    the loop's slopes bit for bit ``fit_slope_cells.slope32``'s, numpy's float32 steps of the
    same cells (fused multiply-adds formed in float64 and rounded once)."""
    if not cpu_loops._vector_loops().supported():
        pytest.skip("the CPU has no AVX-512")
    monkeypatch.setattr(cpu_loops, "VECTOR_LOOP", True)
    y_star = branch.minimum(name)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20_000, generator=g, dtype=torch.float64) * 3,
                   y_star - torch.logspace(-3, 1.5, 5000, dtype=torch.float64)])
    z = torch_activation(name)(x).float()
    left = x < y_star
    got = cpu_loops.activation_grad(z, torch.ones_like(z), branch.pack_bits(left), name,
                                    branch.SLOPES[name])
    fitted = next(f for f in RECORDED["fits"] if f["name"] == name)
    want = _script().slope32(z.numpy(), left.numpy(), fitted)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.skipif(not cpu_loops.available(), reason="Numba is not installed")
def test_vector_loop_is_refused_where_it_cannot_run(monkeypatch):
    """A Numba target named without AVX-512 (``NUMBA_CPU_FEATURES``, as for a cache shared
    between machines), or a loop that does not build: the scalar loop runs (a warning says
    why in the second case)."""
    import numba

    from iabn.kernels import vector_loops

    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2,+fma")
    assert vector_loops.supported.__wrapped__() is False
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx512f,+avx2")

    def broken(*args):
        raise RuntimeError("LLVM ERROR: Cannot select")

    monkeypatch.setattr(vector_loops, "backward", broken)
    with pytest.warns(RuntimeWarning, match="scalar loop runs instead"):
        assert vector_loops.supported.__wrapped__() is False


@pytest.mark.skipif(not cpu_loops.available(), reason="Numba is not installed")
def test_vector_loop_refuses_tables_it_was_not_compiled_for():
    """A compiled loop from Numba's cache reads the degree it was compiled with; tables of
    another size (a fit of another degree) are refused, not read wrongly."""
    from iabn.kernels import vector_loops

    if not vector_loops.supported():
        pytest.skip("the CPU has no AVX-512")
    tables, scalars = vector_loops.constants("silu", branch.SPLIT["silu", torch.float32][:2])
    z = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="do not fit the compiled loop"):
        vector_loops.backward(z, z, np.zeros(2, np.uint8), z.copy(), tables[:-32], scalars)
