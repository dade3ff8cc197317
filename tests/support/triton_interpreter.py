"""A fix for Triton's CPU interpreter, so that it converts like the GPU does.

Triton's interpreter (3.8, which torch 2.14.1 pins, as 3.9 and 3.6) converts float32 to
bfloat16 by truncating the mantissa, and its round-to-nearest-even mode adds the rounding bit
without carrying into the exponent (see ``triton.runtime.interpreter._convert_float``). A GPU
rounds to nearest even (``cvt.rn``), as PyTorch does. Kernels that store bfloat16 would look up
to one unit in the last place worse under the interpreter than on the device, so the tests'
precision bounds (twice PyTorch's own error) would measure the interpreter, not the kernels.
Only that one conversion is replaced;
:func:`test_triton.test_interpreter_bfloat16_conversion_rounds_like_torch` checks it.
"""

from __future__ import annotations

import numpy as np


def _float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # round half to even: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
    rounded = rounded.astype(np.uint16)
    nan = np.isnan(values)
    rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)  # stay a quiet NaN
    return rounded.reshape(values.shape)


def install() -> None:
    """Patch the interpreter's float conversion (idempotent; no-op without Triton)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._convert_float
    if getattr(original, "_iabn_rounding_fix", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _float32_to_bfloat16_bits(input)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._iabn_rounding_fix = True
    interpreter._convert_float = convert
