"""Fits the slope tables of the activations with one minimum for the CPU's vector loop
(``iabn/kernels/slope_cells.py``, used by ``iabn/kernels/vector_loops.py``): the slope
``phi'(y)`` as a function of the output ``z`` on both branches as one table of 32 cells with
one polynomial of degree 7 each, so that a 16-lane loop looks up each coefficient of an
element's cell in two vector registers (one permute) instead of choosing between pieces or
gathering the left elements.

The cells (:data:`LAYOUT`: ``R`` right, ``N`` near, ``F`` far, ``R + N + F = 32``):

- right branch (``y >= y*``): ``s = sqrt(z - z*)`` on ``[0, S]`` in ``R`` equal cells,
  ``phi' = s h`` (``h`` smooth at the minimum, where ``phi'`` goes as ``s``); beyond ``S`` the
  slope is ``S h(S)`` (1 to 2e-8, ``benchmarks/fit_inverse.py``'s ``X_R``);
- left branch (``y < y*``, ``z* < z < 0``) near the minimum, ``z <= z_b = -2^E``: ``N`` equal
  cells in ``s`` on ``[0, sqrt(z_b - z*)]``, ``phi' = s h``;
- left branch below ``2^E``: one cell per binade of ``-z``, ``F`` of them, in ``t = 2 m - 3``
  (``m`` the mantissa of ``-z``, in ``[1, 2)``), ``phi' = z h`` (the slope over the output is
  smooth within a binade; a binade's ends are where the float's exponent changes, so no cell
  straddles a kink of the variable). Below the last binade the last cell is used with its own
  ``t``: that error is checked (``tail``) down to 30 binades further.

Each cell's ``h`` in ``t`` (cells in ``s``: ``t = s c - (floor(s c) + 1/2)``, ``c`` the cells
per unit of ``s`` as float32 holds it, in one fused multiply-add: its rounding is of ``t``, at
most 2^-25, not of ``s c``, up to 32 times more) is a Chebyshev least-squares fit weighted by
the multiplier (``s`` or ``|z|``, so that the error of the slope is what is fitted), converted
to powers of ``t``. Checked in float64 and in float32 as the loop computes it (fused
multiply-adds emulated in float64, one rounding), against the slope at the exact inverse of
each float32 output (bisection in float64 on the branch). Errors are absolute (the slopes lie
in [-0.11, 1.13]).

SciPy is used here only. Writes ``benchmarks/results/fit_slope_cells.json`` and, with
``--write-module``, ``src/iabn/kernels/slope_cells.py`` (both atomically).

Usage::

    python benchmarks/fit_slope_cells.py [--degree 7] [--write-module] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
from numpy.polynomial import chebyshev

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_inverse import ACTIVATIONS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODULE = ROOT / "src" / "iabn" / "kernels" / "slope_cells.py"
CELLS = 32
#: Per activation ``(R, N, F, E)``: right cells, left cells near the minimum, left binades, and
#: ``E`` of the boundary ``z_b = -2^E`` (a power of 2 below ``|z*|`` by a binade or more, so
#: that the near cells stay clear of the singularity at ``z = 0``). SiLU's and Mish's slope over
#: the output changes little from binade to binade far out (16 binades reach a tail error of
#: 5.8e-9); GELU's changes by about 0.14 a binade (its tail: 1.3e-7 after 16 binades, 3.2e-8
#: after 18), so it takes two right cells fewer (right error 1.2e-8 with 10 cells, 2.2e-9
#: with 12).
LAYOUT = {"silu": (12, 4, 16, -3), "mish": (12, 4, 16, -3), "gelu": (10, 4, 18, -4),
          "gelu_tanh": (10, 4, 18, -4)}
#: Beyond ``S`` the right slope is within this of 1 (as ``fit_inverse.py``'s ``X_R``).
FLAT = 2e-8
SAMPLES = 1500  # per cell


def _split32(x: float) -> tuple[np.float32, np.float32]:
    hi = np.float32(x)
    return hi, np.float32(x - np.float64(hi))


def _invert(f, z, low, high, right: bool):
    """float64 ``y`` with ``phi(y) = z`` on one branch, by bisection (``[low, high]``)."""
    lo = np.full(z.shape, low, dtype=np.float64)
    hi = np.full(z.shape, high, dtype=np.float64)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        value = f(mid)[0]
        # right branch: phi increases; left branch: phi decreases in y
        above = value > z if right else value < z
        hi = np.where(above, mid, hi)
        lo = np.where(above, lo, mid)
    return 0.5 * (lo + hi)


def right_limit(name: str) -> float:
    """``S``: ``s`` where the right slope comes within :data:`FLAT` of 1 for good."""
    f, y_star, z_star = ACTIVATIONS[name]
    y = y_star + np.geomspace(1e-3, 60, 400_000)
    slope = f(y)[1]
    last = y[np.nonzero(np.abs(slope - 1) > FLAT)[0].max()]
    return float(np.sqrt(f(np.array([last]))[0][0] - z_star))


def _cell_fit(t, target, weight, degree: int):
    """Powers of ``t`` (``t`` in ``[-1/2, 1/2]``) of the weighted Chebyshev fit of ``target``."""
    c = chebyshev.chebfit(2 * t, target, degree, w=weight)
    powers = chebyshev.cheb2poly(c)  # powers of 2 t
    return [float(a * 2.0 ** k) for k, a in enumerate(powers)]


def _horner(powers, t):
    acc = np.full_like(t, powers[-1])
    for a in powers[-2::-1]:
        acc = acc * t + a
    return acc


def _samples_in_s(f, y_star, z_star, s, right: bool, y_far: float):
    z = z_star + s * s
    y = _invert(f, z, y_star, y_far, right) if right else _invert(f, z, y_far, y_star, right)
    return z, f(y)[1]


def fit(name: str, degree: int) -> dict:
    f, y_star, z_star = ACTIVATIONS[name]
    right, near, far, exponent = LAYOUT[name]
    s_max = right_limit(name)
    y_right_far = y_star + 80
    y_left_far = -40.0
    cells, errors = [], {"right": 0.0, "near": 0.0, "far": 0.0, "tail": 0.0}

    def cells_in_s(count, scale, right_branch, key):
        # cells of width 1 / scale, the scale as float32 holds it (the loop computes
        # t = s scale - (cell + 1/2) in one fused multiply-add)
        for j in range(count):
            t = np.linspace(-0.5, 0.5, SAMPLES)
            s = np.maximum((j + 0.5 + t) / scale, 1e-7)
            _, slope = _samples_in_s(f, y_star, z_star, s, right_branch,
                                     y_right_far if right_branch else y_left_far)
            powers = _cell_fit(t, slope / s, s, degree)
            cells.append(powers)
            errors[key] = max(errors[key], float(np.abs(_horner(powers, t) * s - slope).max()))

    right_scale = float(np.float32(right / s_max))
    cells_in_s(right, right_scale, True, "right")
    z_b = -(2.0 ** exponent)
    s_b = float(np.sqrt(z_b - z_star))
    near_scale = float(np.float32(near / s_b))
    cells_in_s(near, near_scale, False, "near")

    def binade(e, samples):  # -z in [2^e, 2^(e+1)), t = 2 m - 3
        t = np.linspace(-1.0, 1.0, samples)
        z = -(1.5 + 0.5 * t) * 2.0 ** e
        y = _invert(f, z, -60.0, y_star, False)
        return t, z, f(y)[1]

    for k in range(far):
        t, z, slope = binade(exponent - 1 - k, SAMPLES)
        # fitted in t / 2, as the cells in s, then in powers of t
        powers = _cell_fit(t / 2, slope / z, np.abs(z), degree)
        cells.append([a / 2.0 ** i for i, a in enumerate(powers)])
        errors["far"] = max(errors["far"], float(np.abs(_horner(cells[-1], t) * z - slope).max()))
    for k in range(far, far + 30):  # below the last binade: its cell with the binade's own t
        t, z, slope = binade(exponent - 1 - k, 200)
        errors["tail"] = max(errors["tail"],
                             float(np.abs(_horner(cells[-1], t) * z - slope).max()))
    constants = {"right_cells": right, "near_cells": near, "far_cells": far, "s_max": s_max,
                 "right_scale": right_scale, "left_exponent": exponent, "z_b": z_b, "s_b": s_b,
                 "near_scale": near_scale}
    return {"name": name, "degree": degree, "constants": constants, "cells": cells,
            "error_float64": errors}


# ------------------------------------------------------- the loop's float32 arithmetic


def _fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(
        np.float32)


def slope32(z, left, fitted: dict):
    """The slope as the vector loop computes it, in float32 (numpy; fused multiply-adds
    rounded once)."""
    f32 = np.float32
    _, _, z_star = ACTIVATIONS[fitted["name"]]
    c = fitted["constants"]
    right, near, far = c["right_cells"], c["near_cells"], c["far_cells"]
    z_hi, z_lo = _split32(z_star)
    d = np.maximum((z - z_hi) - z_lo, f32(0))
    s = np.sqrt(d).astype(f32)
    # right
    s_c = np.minimum(s, f32(c["s_max"]))
    u = (s_c * f32(c["right_scale"])).astype(f32)
    cell_r = np.minimum(np.floor(u), f32(right - 1))
    t_r = _fma(s_c, np.full_like(s, c["right_scale"]), -(cell_r + f32(0.5)))
    # left, near
    u = (s * f32(c["near_scale"])).astype(f32)
    cell_n = np.minimum(np.floor(u), f32(near - 1))
    t_n = _fma(s, np.full_like(s, c["near_scale"]), -(cell_n + f32(0.5)))
    # left, far: the binade of -z and its mantissa
    bits = (-z).astype(f32).view(np.int32)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(f32)
    cell_f = right + near + np.clip(c["left_exponent"] - 1 - e, 0, far - 1)
    t_f = _fma(m, np.full_like(m, 2), np.full_like(m, -3))
    near_side = z <= f32(c["z_b"])
    cell_l = np.where(near_side, right + cell_n.astype(np.int64), cell_f)
    cells = np.where(left, cell_l, cell_r.astype(np.int64))
    t = np.where(left, np.where(near_side, t_n, t_f), t_r)
    multiplier = np.where(left, np.where(near_side, s, z), s_c)
    coefficients = np.array(fitted["cells"], dtype=f32)[cells]
    h = coefficients[:, -1]
    for k in range(coefficients.shape[1] - 2, -1, -1):
        h = _fma(h, t, coefficients[:, k])
    return (h * multiplier).astype(f32)


def float32_errors(fitted: dict) -> dict:
    """Largest absolute error of :func:`slope32` against the exact slope at each float32 output
    (the inverse by bisection in float64), per branch, over outputs across each branch: its
    whole range in ``s`` (right, to 60 beyond ``y*``), and on the left down to the binades'
    end and below."""
    f, y_star, z_star = ACTIVATIONS[fitted["name"]]
    out = {}
    y_right = y_star + np.concatenate([np.geomspace(1e-4, 60, 60_000),
                                       np.linspace(0, 8, 60_000)])
    y_left = y_star - np.concatenate([np.geomspace(1e-4, 38, 60_000),
                                      np.linspace(0, 8, 60_000)])
    for branch, y in (("right", y_right), ("left", y_left)):
        z32 = f(y)[0].astype(np.float32)
        if branch == "left":
            z32 = z32[(z32 < 0) & (z32 > np.float32(z_star))]
        right = branch == "right"
        exact_y = (_invert(f, z32.astype(np.float64), y_star, y_star + 80, True) if right
                   else _invert(f, z32.astype(np.float64), -40.0, y_star, False))
        exact = f(exact_y)[1]
        got = slope32(z32, np.full(z32.shape, not right), fitted).astype(np.float64)
        error = np.abs(got - exact)
        far = np.abs(exact_y - y_star) > 0.05
        out[branch] = {"all": float(error.max()), "farther_than_0.05": float(error[far].max())}
    return out


def module_text(fits: list[dict]) -> str:
    lines = [
        '"""The slope tables of the CPU\'s vector loop (:mod:`.vector_loops`): per activation',
        "with one minimum, one table of 32 cells (right branch, left branch near the minimum,",
        "left binades) with one polynomial of degree 7 each, and the constants that map an",
        "output to its cell. Written by ``benchmarks/fit_slope_cells.py`` (which records their",
        'errors in ``benchmarks/results/fit_slope_cells.json``); do not edit by hand."""',
        "",
        "#: ``{name: (constants, cells)}``; a cell is its powers of ``t``.",
        "TABLES = {",
    ]
    for fitted in fits:
        lines.append(f"    \"{fitted['name']}\": (")
        lines.append("        {")
        lines += [f"            \"{key}\": {value!r},"
                  for key, value in fitted["constants"].items()]
        lines.append("        },")
        lines.append("        (")
        for powers in fitted["cells"]:
            items = [repr(float(np.float32(a))) + "," for a in powers]
            # three numbers a line (a line of the module stays within 100 characters)
            rows = [" ".join(items[i:i + 3]) for i in range(0, len(items), 3)]
            lines.append("            (" + rows[0])
            lines += ["             " + row for row in rows[1:]]
            lines[-1] += "),"
        lines.append("        ),")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degree", type=int, default=7)
    parser.add_argument("--names", default=",".join(ACTIVATIONS))
    parser.add_argument("--write-module", action="store_true",
                        help=f"write {MODULE.relative_to(ROOT)}")
    parser.add_argument("--json", default=str(RESULTS / "fit_slope_cells.json"))
    args = parser.parse_args(argv)
    names = args.names.split(",")
    unknown = [n for n in names if n not in ACTIVATIONS]
    if unknown or args.degree < 1:
        parser.error(f"--names: unknown {unknown}; choose from {', '.join(ACTIVATIONS)}"
                     if unknown else "--degree: give 1 or more")
    if args.write_module and sorted(names) != sorted(ACTIVATIONS):
        parser.error("--write-module: the module holds every activation's table; leave out "
                     "--names")
    fits = []
    for name in names:
        fitted = fit(name, args.degree)
        fitted["error_float32"] = float32_errors(fitted)
        fits.append(fitted)
        errors = fitted["error_float64"]
        print(f"{name:10s} float64 right {errors['right']:.2e} near {errors['near']:.2e} far "
              f"{errors['far']:.2e} tail {errors['tail']:.2e} | float32 right "
              f"{fitted['error_float32']['right']['all']:.2e} left "
              f"{fitted['error_float32']['left']['all']:.2e}", flush=True)
    record = {"degree": args.degree, "cells": CELLS, "machine": platform.machine(),
              "fits": fits}
    _write_atomic(Path(args.json), json.dumps(record, indent=1) + "\n")
    if args.write_module:
        _write_atomic(MODULE, module_text(fits))
        print(f"wrote {MODULE}")
    return fits


if __name__ == "__main__":
    main()
