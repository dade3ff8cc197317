"""Fits the left branch's slope of the activations with one minimum as a function of their
output, and records how well polynomials in the output reach either branch (docs/design.md,
"SiLU and GELU in place": "The left branch's slope, fitted").

Left branch (``y < y*``, ``z* < z < 0``). With ``v = sqrt(log(z* / z))`` (the ``H`` of the
Newton steps, close to linear in ``y``) the ratio ``R(v) = phi'(y) / phi(y)`` is smooth on
``[0, V]`` and bounded; the slope is ``dy/dx = z R(v)``, so an error ``e`` of ``R`` is an error
``|z| e`` of the slope: the fit is weighted by ``|z|`` and stops at ``z = -Z_FLOOR`` (beyond,
``R(V)`` is used, an error of at most ``Z_FLOOR`` in the slope). It is a Chebyshev
least-squares fit in ``t = 2 v / V - 1`` on samples dense in ``y``, converted to powers of
``t`` for Horner's rule, and checked in float32 (numpy, the same operations as the library).

Right branch (``y >= y*``). Its slope as ``s h(s)``, ``s = sqrt(z - z*)``, ``h`` two
polynomials of degree 16 split at ``s = E`` (one polynomial reaching float32's rounding on all
of ``[y*, X_R]`` needs a degree above 24, beyond ``X_R`` the slope is 1 to 2e-8; a 12/12
rational loses it in float32, its denominator near 0.04): ``iabn.kernels.branch.RIGHT_SLOPE``.
Also the inverse ``y(s)`` as one degree-16 polynomial (within 2.2e-5 of ``max(|y|, 1)``), once
the start of one Newton step in the library's right branch (recorded, no longer used: the
fitted slopes need no ``y``).

The inverses (recorded, not used). ``y`` on each branch as three pieces of degree 16 that add
(:func:`fit_pieces`): right ``y = z + r(s)``, left ``y(v)`` down to the smallest float32
subnormal. Within 1.9e-10 .. 4.4e-9 of ``max(|y|, 1)`` in float64, but evaluated in float32
(power basis, plain steps) 1.2e-7 .. 2.2e-7 (right) and 2.6e-7 .. 6.5e-7 (left, near ``y*``,
where Horner's sum cancels): above the rounding of ``y`` that Newton's steps reach.

SciPy and NumPy are used here only, never when the library is imported. Writes
``benchmarks/results/fit_inverse.json`` (coefficients, errors by degree, float32 error of the
chosen fit) and prints the coefficients in the form ``iabn/kernels/branch.py`` holds them.

Usage::

    python benchmarks/fit_inverse.py [--degree 12] [--right-degree 16] [--only-inverse]
        [--json benchmarks/results/fit_inverse.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import warnings
from pathlib import Path

import numpy as np
from numpy.polynomial import chebyshev
from scipy.special import erfc, expit

RESULTS = Path(__file__).resolve().parent / "results"
#: Below this ``|z|`` the left fit is held at its end (slope error at most this).
Z_FLOOR = 1e-9
_BETA = np.sqrt(2 / np.pi)
_KAPPA = 0.044715


def _silu(x):
    s = expit(x)
    return x * s, s * (1 + x * (1 - s))


def _gelu(x):
    cdf = 0.5 * erfc(-x / np.sqrt(2))
    return x * cdf, cdf + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi)


def _gelu_tanh(x):
    v = 2 * _BETA * (x + _KAPPA * x ** 3)
    s = expit(v)
    return x * s, s + x * s * expit(-v) * 2 * _BETA * (1 + 3 * _KAPPA * x * x)


def _mish(x):
    t = np.tanh(np.logaddexp(0, x))
    return x * t, t + x * expit(x) * (1 - t * t)


#: ``(phi and phi', y*, z*)``, the minima as ``iabn.kernels.activations`` holds them.
ACTIVATIONS = {
    "silu": (_silu, -1.278464542761074, -0.27846454276107385),
    "gelu": (_gelu, -0.7517915246935645, -0.16997120747990363),
    "gelu_tanh": (_gelu_tanh, -0.7524614220710163, -0.17004075057125406),
    "mish": (_mish, -1.1924312145154954, -0.3088434130172504),
}


def _left_samples_y(y_star):
    return y_star - np.geomspace(1e-7, 120, 400_000)


def _left_samples(f, y_star, z_star):
    y = _left_samples_y(y_star)
    z, slope = f(y)
    keep = z < -Z_FLOOR
    z, slope = z[keep], slope[keep]
    return np.sqrt(np.log(z_star / z)), z, slope


def fit_left(name: str, degree: int) -> dict:
    f, y_star, z_star = ACTIVATIONS[name]
    v, z, slope = _left_samples(f, y_star, z_star)
    v_max = float(v.max())
    t = 2 * v / v_max - 1
    ratio = slope / z
    by_degree = {}
    for d in (8, 10, 12, 14, 16):
        c = chebyshev.chebfit(t, ratio, d, w=np.abs(z))
        by_degree[d] = float((np.abs(chebyshev.chebval(t, c) - ratio) * np.abs(z)).max())
    c = chebyshev.chebfit(t, ratio, degree, w=np.abs(z))
    powers = chebyshev.cheb2poly(c)
    # float32, as the library evaluates it: z, log1p, sqrt, Horner in t, times z
    z32 = z.astype(np.float32)
    # log(z* / z) = log1p((z - z*) / -z), z* in two float32 parts (z - z*_hi is exact near
    # z*): log(z* / z) in float32 has an error of eps, not eps of itself, near the minimum
    z_hi = np.float32(z_star)
    z_lo = np.float32(z_star - np.float64(z_hi))
    above = (z32 - z_hi) - z_lo
    v32 = np.sqrt(np.maximum(np.log1p(above / -z32), 0)).astype(np.float32)
    t32 = np.minimum(v32 * np.float32(2 / v_max) - np.float32(1), np.float32(1))
    acc = np.full_like(t32, np.float32(powers[-1]))
    for a in powers[-2::-1]:
        acc = (acc * t32 + np.float32(a)).astype(np.float32)
    slope32 = (acc * z32).astype(np.float32)
    # against the exact slope at the float32 output (y refined by float64 Newton steps on
    # log(-phi)), farther than 0.05 from y* (nearer, the rounding of z moves y by sqrt(eps))
    y = _left_samples_y(y_star)[: z.size]
    far = y < y_star - 0.05
    y = y[far]
    target = np.log(-z32[far].astype(np.float64))
    for _ in range(4):
        value, derivative = f(y)
        y = y - (np.log(-value) - target) / (derivative / value)
    error32 = float(np.abs(slope32[far].astype(np.float64) - f(y)[1]).max())
    return {"v_max": v_max, "degree": degree, "powers_of_t": [float(a) for a in powers],
            "weighted_error_by_degree": by_degree, "float32_slope_error_far": error32,
            "samples": int(z.size), "y_range": [float(y_star - 120), y_star]}


def _horner32(powers, t32):
    acc = np.full_like(t32, np.float32(powers[-1]))
    for a in powers[-2::-1]:
        acc = (acc * t32 + np.float32(a)).astype(np.float32)
    return acc


def _right_samples(f, y_star, z_star, first: float):
    """``(y, z, slope, s)`` of the right branch from ``first`` above ``y*`` to ``X_R``, beyond
    which the slope is 1 to 2e-8 (float32 rounds slopes near 1 in steps of 6e-8 and 1.2e-7)."""
    y = y_star + np.geomspace(first, 60, 400_000)
    z, slope = f(y)
    x_r = y[np.nonzero(np.abs(slope - 1) > 2e-8)[0].max()]
    keep = y <= x_r
    y, z, slope = y[keep], z[keep], slope[keep]
    return y, z, slope, np.sqrt(np.maximum(z - z_star, 0))


def _fit_piece(s, slope, low: float, high: float, degree: int):
    """Chebyshev coefficients of ``h = slope / s`` on ``[low, high]`` in ``t = 2 (s - low) /
    (high - low) - 1``, least squares weighted by ``s`` (the error of ``s h``), and that
    error's largest value."""
    m = (s >= low) & (s <= high)
    t = 2 * (s[m] - low) / (high - low) - 1
    c = chebyshev.chebfit(t, slope[m] / s[m], degree, w=s[m])
    return c, float(np.abs(chebyshev.chebval(t, c) * s[m] - slope[m]).max())


def _fit_near(s, slope, edge: float, degree: int, c: float):
    """``h = c + (t - 1) q(t)`` on ``[0, edge]``, ``t = 2 s / edge - 1``: ``q`` (degree
    ``degree - 1``, Chebyshev least squares weighted by ``s |t - 1|``) so that ``h(edge) = c``
    exactly, the far piece's value there; the two pieces then add without a choice per
    element. Returns ``q``'s powers of ``t`` and the largest error of ``s h``."""
    m = (s > 0) & (s < edge * (1 - 1e-9))
    t = 2 * s[m] / edge - 1
    qc = chebyshev.chebfit(t, (slope[m] / s[m] - c) / (t - 1), degree - 1,
                           w=s[m] * np.abs(t - 1))
    error = float(np.abs((c + (t - 1) * chebyshev.chebval(t, qc)) * s[m] - slope[m]).max())
    return [float(a) for a in chebyshev.cheb2poly(qc)], error


def right_slope32(z32, z_star, fit):
    """The right slope as the library evaluates it in float32 (``branch.right_slope``):
    ``s (far(t_far) + (t_near - 1) q(t_near))`` with each ``t`` held to its piece."""
    s_max, edge = fit["s_max"], fit["edge"]
    f32 = np.float32
    z_hi = f32(z_star)
    z_lo = f32(z_star - np.float64(z_hi))
    s = np.sqrt(np.maximum((z32 - z_hi) - z_lo, f32(0))).astype(f32)
    u = np.minimum(s * f32(2 / edge) - f32(2), f32(0)).astype(f32)  # t_near - 1
    near = (_horner32(fit["near_q_powers_of_t"], (u + f32(1)).astype(f32)) * u).astype(f32)
    width = s_max - edge
    t_far = np.clip(s * f32(2 / width) - f32((s_max + edge) / width), f32(-1), f32(1))
    h = (_horner32(fit["far_powers_of_t"], t_far.astype(f32)) + near).astype(f32)
    return (h * np.minimum(s, f32(s_max))).astype(f32)


def _fit_right_pieces(s, slope, s_max: float, edge: float, degree: int):
    far, far_error = _fit_piece(s, slope, edge, s_max, degree)
    near, near_error = _fit_near(s, slope, edge, degree, float(chebyshev.chebval(-1, far)))
    return near, [float(a) for a in chebyshev.cheb2poly(far)], max(near_error, far_error)


def fit_right_slope(name: str, degree: int) -> dict:
    """The right branch's slope ``phi'(y) = s h(s)``, ``s = sqrt(z - z*)``, ``h`` two
    polynomials of ``degree`` split at ``s = E`` (of 0.25, 0.3 .. 0.75 ``S``, the one with the
    smallest largest error), the near one pinned to the far one's value at ``E``
    (:func:`_fit_near`); beyond ``S`` the slope is ``S h(S)``, 1 to 2e-8."""
    f, y_star, z_star = ACTIVATIONS[name]
    y, _, slope, s = _right_samples(f, y_star, z_star, 1e-5)
    s_max = float(s.max())
    by_degree = {}
    for d in sorted({12, 14, degree}):
        by_degree[d] = min((_fit_right_pieces(s, slope, s_max, float(e), d)[2], float(e))
                           for e in np.linspace(0.25, 0.75, 11) * s_max)
    error, edge = by_degree[degree]
    near, far, _ = _fit_right_pieces(s, slope, s_max, edge, degree)
    fit = {"s_max": s_max, "x_r": float(y[-1]), "edge": edge, "degree": degree,
           "near_q_powers_of_t": near, "far_powers_of_t": far,
           "error_float64": error,
           "error_float64_by_degree": {d: e for d, (e, _) in by_degree.items()}}
    # float32 against the exact slope at the float32 output: y refined by float64 Newton
    # steps on phi; farther than 0.05 from y* (nearer, the rounding of z moves y by
    # sqrt(eps), and the slope with it), and beyond X_R up to 60 from y*
    y = _right_samples(f, y_star, z_star, 0.05)[0]
    y = np.concatenate([y, y[-1] + np.linspace(0, 60, 10_000)])
    z32 = f(y)[0].astype(np.float32)
    target = z32.astype(np.float64)
    for _ in range(4):
        value, derivative = f(y)
        y = y - (value - target) / derivative
    fit["float32_slope_error_far"] = float(
        np.abs(right_slope32(z32, z_star, fit).astype(np.float64) - f(y)[1]).max())
    return fit


def fit_right_start(name: str, degree: int) -> dict:
    """The right branch's inverse ``y(s)``, ``s = sqrt(z - z*)``, as a polynomial in
    ``t = 2 s / S - 1`` up to ``S``, beyond which ``y = z`` to 2e-8 relative (``z_r``): the
    start of the right branch's Newton steps (float32 and half inputs)."""
    f, y_star, z_star = ACTIVATIONS[name]
    y = y_star + np.geomspace(1e-8, 60, 400_000)
    z, _ = f(y)
    z_r_index = np.nonzero(np.abs(y - z) > 2e-8 * np.maximum(np.abs(y), 1))[0].max()
    keep = np.arange(y.size) <= z_r_index
    y, z = y[keep], z[keep]
    s = np.sqrt(np.maximum(z - z_star, 0))
    s_max = float(s.max())
    t = 2 * s / s_max - 1
    c = chebyshev.chebfit(t, y, degree)
    powers = chebyshev.cheb2poly(c)
    z32 = z.astype(np.float32)
    z_hi = np.float32(z_star)
    z_lo = np.float32(z_star - np.float64(z_hi))
    above = np.clip((z32 - z_hi) - z_lo, 0, np.float32(s_max * s_max))
    t32 = np.sqrt(above) * np.float32(2 / s_max) - np.float32(1)
    start32 = _horner32(powers, t32.astype(np.float32))
    scale = np.maximum(np.abs(y), 1)
    return {"s_max": s_max, "z_r": float(z[-1]), "degree": degree,
            "powers_of_t": [float(a) for a in powers],
            "relative_error_float64": float((np.abs(chebyshev.chebval(t, c) - y) / scale).max()),
            "relative_error_float32": float((np.abs(start32 - y) / scale).max())}


def fit_pieces(x, target, scale, edges, degree: int) -> tuple[list, float]:
    """``target(x)`` as a sum of pieces over ``edges``: the first a plain polynomial in
    ``t = 2 (x - a) / (b - a) - 1`` of its ``[a, b]``, each next one ``(t + 1) q(t)``, 0 at its
    left end, fitted to what the pieces before leave (Chebyshev least squares weighted by
    ``1 / scale``); each ``t`` is held to ``[-1, 1]``, so every piece is evaluated on every
    element and they add, no choice per element. Returns the pieces as
    ``(a, b, powers of t)`` (a next piece's powers are ``q``'s) and the largest error over
    ``scale`` in float64."""
    pieces, rest, error = [], target.astype(np.float64).copy(), 0.0
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        t_all = np.clip(2 * (x - a) / (b - a) - 1, -1, 1)
        m = (x >= a) & (x <= b)
        t = t_all[m]
        if k == 0:
            c = chebyshev.chebfit(t, rest[m], degree, w=1 / scale[m])
            value = chebyshev.chebval(t_all, c)
        else:
            inner = t > -1 + 1e-12
            c = chebyshev.chebfit(t[inner], rest[m][inner] / (t[inner] + 1), degree - 1,
                                  w=(t[inner] + 1) / scale[m][inner])
            value = (t_all + 1) * chebyshev.chebval(t_all, c)
        rest = rest - value
        pieces.append((float(a), float(b), [float(v) for v in chebyshev.cheb2poly(c)]))
        error = max(error, float((np.abs(rest[m]) / scale[m]).max()))
    return pieces, float((np.abs(rest) / scale).max())


def pieces32(x32, pieces):
    """:func:`fit_pieces`' sum as the library evaluates it in float32 (plain steps)."""
    f32 = np.float32
    total = np.zeros_like(x32)
    for k, (a, b, powers) in enumerate(pieces):
        t = np.clip(x32 * f32(2 / (b - a)) - f32((a + b) / (b - a)), f32(-1), f32(1))
        t = t.astype(f32)
        value = _horner32(powers, t)
        if k:
            value = (value * (t + f32(1))).astype(f32)
        total = (total + value).astype(f32)
    return total


def _exact_inverse(f, y, z32):
    """``y`` refined by float64 Newton steps to ``phi(y) = z32`` (float64 of the float32)."""
    target = z32.astype(np.float64)
    for _ in range(6):
        value, derivative = f(y)
        y = y - (value - target) / derivative
    return y


def fit_inverse(name: str, degree: int, count: int) -> dict:
    """The inverse on each branch as ``count`` pieces of ``degree`` (:func:`fit_pieces`),
    errors over ``max(|y|, 1)``. Right: ``y = z + r(s)``, ``s = sqrt(z - z*)``, ``r = y - z``
    up to where ``|r| <= 1e-8 max(|y|, 1)`` (``z_r``; beyond, ``y = z``). Left: ``y(v)``,
    ``v = sqrt(log(z* / z))``, down to the smallest float32 subnormal (an output that rounded
    to 0 is taken as that, as ``branch.invert`` does)."""
    f, y_star, z_star = ACTIVATIONS[name]
    z_hi = np.float32(z_star)
    z_lo = np.float32(z_star - np.float64(z_hi))
    result = {"degree": degree, "pieces": count}
    y = y_star + np.geomspace(1e-6, 60, 400_000)
    z, _ = f(y)
    scale = np.maximum(np.abs(y), 1)
    last = np.nonzero(np.abs(y - z) > 1e-8 * scale)[0].max()
    y, z, scale = y[: last + 1], z[: last + 1], scale[: last + 1]
    s = np.sqrt(np.maximum(z - z_star, 0))
    pieces, error = fit_pieces(s, y - z, scale, np.linspace(0, s.max(), count + 1), degree)
    # float32 against the exact inverse of the float32 output, farther than 0.05 from y*
    yf = y_star + np.geomspace(0.05, 60, 200_000)
    z32 = f(yf)[0].astype(np.float32)
    exact = _exact_inverse(f, yf, z32)
    s32 = np.sqrt(np.maximum((z32 - z_hi) - z_lo, np.float32(0))).astype(np.float32)
    got = (z32 + pieces32(s32, pieces)).astype(np.float32)
    result["right"] = {"z_r": float(z[-1]), "pieces": pieces, "error_float64": error,
                       "float32_error_far": float((np.abs(got - exact)
                                                   / np.maximum(np.abs(exact), 1)).max())}
    y = y_star - np.geomspace(1e-6, 120, 400_000)
    z, _ = f(y)
    keep = z <= -float(np.finfo(np.float32).smallest_subnormal) / 2  # past the smallest
    y, z = y[keep], z[keep]
    v = np.sqrt(np.log(z_star / z))
    scale = np.maximum(np.abs(y), 1)
    pieces, error = fit_pieces(v, y, scale, np.linspace(0, v.max(), count + 1), degree)
    yf = y_star - np.geomspace(0.05, 120, 200_000)
    z32 = f(yf)[0].astype(np.float32)
    yf, z32 = yf[z32 < 0], z32[z32 < 0]
    exact = _exact_inverse(f, yf, z32)
    # log(z* / z): log1p((z - z*) / -z) near the minimum, log(-z*) - log(-z) beyond (where
    # the ratio would overflow for subnormal z)
    ratio = (((z32 - z_hi) - z_lo) / -z32).astype(np.float32)
    with np.errstate(over="ignore"):
        log_ratio = np.where(ratio <= 1, np.log1p(np.minimum(ratio, 1)),
                             np.float32(np.log(-z_star)) - np.log(-z32)).astype(np.float32)
    v32 = np.sqrt(np.maximum(log_ratio, 0)).astype(np.float32)
    got = pieces32(v32, pieces)
    result["left"] = {"v_max": float(v.max()), "pieces": pieces, "error_float64": error,
                      "float32_error_far": float((np.abs(got - exact)
                                                  / np.maximum(np.abs(exact), 1)).max())}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degree", type=int, default=12, help="of the left polynomial")
    parser.add_argument("--right-degree", type=int, default=16,
                        help="of the right slope's two polynomials")
    parser.add_argument("--start-degree", type=int, default=16,
                        help="of the right branch's start y(s)")
    parser.add_argument("--inverse-degree", type=int, default=16,
                        help="of each piece of the fitted inverses")
    parser.add_argument("--inverse-pieces", type=int, default=3,
                        help="pieces of each branch's fitted inverse")
    parser.add_argument("--only-inverse", action="store_true",
                        help="fit the inverses only, into the JSON's other fits")
    parser.add_argument("--json", default=str(RESULTS / "fit_inverse.json"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=np.exceptions.RankWarning)
    result = {"script": "benchmarks/fit_inverse.py", "z_floor": Z_FLOOR,
              "numpy": np.__version__, "python": platform.python_version(),
              "left": {}, "right": {}, "right_start": {}, "inverse": {}}
    if args.only_inverse:
        result = {**json.loads(Path(args.json).read_text()), "inverse": {}}
    for name in ACTIVATIONS:
        inverse = fit_inverse(name, args.inverse_degree, args.inverse_pieces)
        result["inverse"][name] = inverse
        print(f"{name}: inverse, error over max(|y|, 1): right "
              f"{inverse['right']['error_float64']:.2e} (float32 far "
              f"{inverse['right']['float32_error_far']:.2e}), left "
              f"{inverse['left']['error_float64']:.2e} (float32 far "
              f"{inverse['left']['float32_error_far']:.2e})", flush=True)
        if args.only_inverse:
            continue
        left = fit_left(name, args.degree)
        result["left"][name] = left
        right = fit_right_slope(name, args.right_degree)
        result["right"][name] = right
        start = fit_right_start(name, args.start_degree)
        result["right_start"][name] = start
        print(f"  right start: error {start['relative_error_float64']:.2e} (float32 "
              f"{start['relative_error_float32']:.2e})")
        print(f"    RIGHT_START[{name!r}] = ({start['s_max']!r}, {start['z_r']!r}, (")
        print("        " + ", ".join(repr(a) for a in start["powers_of_t"]) + "))")
        print(f"{name}: left V={left['v_max']!r}, weighted error by degree "
              f"{left['weighted_error_by_degree']}, "
              f"float32 far {left['float32_slope_error_far']:.2e}")
        print(f"    LEFT_SLOPE[{name!r}] = ({left['v_max']!r}, (")
        print("        " + ", ".join(repr(a) for a in left["powers_of_t"]) + "))")
        print(f"  right slope: S={right['s_max']!r}, error by degree "
              f"{right['error_float64_by_degree']}, float32 far "
              f"{right['float32_slope_error_far']:.2e}")
        print(f"    RIGHT_SLOPE[{name!r}] = ({right['s_max']!r}, {right['edge']!r}, (")
        print("        " + ", ".join(repr(a) for a in right["near_q_powers_of_t"]) + "), (")
        print("        " + ", ".join(repr(a) for a in right["far_powers_of_t"]) + "))")
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
