"""Compile every Triton kernel of iabn for an sm_90 (Hopper) GPU, without a GPU.

Triton ships ``ptxas``, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs on a
CPU machine. Printed as JSON for tests/kernels/test_triton.py, one entry per specialisation: the
kernel's name, the cubin's size and how many float32 and float64 scalar parameters its PTX
declares. Run without
``TRITON_INTERPRET`` (the interpreter replaces the kernels by Python functions).
"""

from __future__ import annotations

import json

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from iabn.kernels import triton_kernels as k

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"momentum", "eps", "param", "tiny", "count"}
F32 = tl.float32
#: The constexprs of the SiLU/GELU path, off.
NO_BRANCH = {"BRANCH": False, "NEWTON": 0, "CHEB": 0, "TAYLOR": False}

CASES = [  # (kernel, pointer types other than *fp32, constexprs)
    # the output-only layer norm's backward: bfloat16 rows of 384 with float32 parameters,
    # and a float64 RMS norm without its weight
    (k.row_norm_grad_kernel, {"y_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16"},
     {"LAYER": True, "HAS_WEIGHT": True, "HAS_BIAS": True, "WANT_DX": True, "WANT_SUMS": True,
      "BLOCK_M": 8, "BLOCK_D": 512, "ACC": F32}),
    (k.row_norm_grad_kernel, {"y_ptr": "*fp64", "dy_ptr": "*fp64", "dx_ptr": "*fp64",
                              "rstd_ptr": "*fp64", "parts_ptr": "*fp64"},
     {"LAYER": False, "HAS_WEIGHT": False, "HAS_BIAS": False, "WANT_DX": True,
      "WANT_SUMS": False, "BLOCK_M": 1, "BLOCK_D": 8192, "ACC": tl.float64}),
    (k.moments_ncs_kernel, {"x_ptr": "*bf16", "parts_ptr": "*fp64"},
     {"BLOCK_N": 2, "BLOCK_S": 1024, "ACC": F32}),
    (k.moments_mc_kernel, {"x_ptr": "*fp16", "parts_ptr": "*fp64"},
     {"BLOCK_R": 32, "BLOCK_C": 64, "ACC": F32}),
    (k.moments_ncs_kernel, {"x_ptr": "*fp64", "parts_ptr": "*fp64"},
     {"BLOCK_N": 32, "BLOCK_S": 64, "ACC": tl.float64}),
    (k.finalize_forward_kernel, {"parts_ptr": "*fp64"},
     {"TRAINING": True, "HAS_WEIGHT": True, "HAS_BIAS": True, "UPDATE_RUNNING": True,
      "GAMMA_ABS": False, "BLOCK_C": 128, "ACC": F32}),
    (k.finalize_forward_kernel, {"invstd_ptr": "*bf16", "scale_ptr": "*bf16"},
     {"TRAINING": False, "HAS_WEIGHT": False, "HAS_BIAS": False, "UPDATE_RUNNING": False,
      "GAMMA_ABS": True, "BLOCK_C": 128, "ACC": F32}),
    (k.normalize_act_kernel, {"x_ptr": "*bf16"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.LEAKY_RELU, "BLOCK_R": 32, "BLOCK_K": 64, "ACC": F32}),
    (k.normalize_act_kernel, {"x_ptr": "*fp16"},
     {"CHANNEL_ON_ROWS": False, "ACT": k.ELU, "BLOCK_R": 8, "BLOCK_K": 256, "ACC": F32}),
    (k.normalize_branch_kernel, {"x_ptr": "*bf16", "bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.SILU, "CHEB": 16, "BLOCK_BYTES": 256, "ACC": F32}),
    (k.normalize_branch_kernel, {"x_ptr": "*fp64", "bits_ptr": "*u8", "coeffs_ptr": "*fp64",
                                 "consts_ptr": "*fp64"},
     {"CHANNEL_ON_ROWS": False, "ACT": k.GELU, "CHEB": 25, "BLOCK_BYTES": 256,
      "ACC": tl.float64}),
    (k.normalize_branch_kernel, {"x_ptr": "*fp16", "bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.MISH, "CHEB": 16, "BLOCK_BYTES": 256, "ACC": F32}),
    (k.normalize_branch_kernel, {"x_ptr": "*fp64", "bits_ptr": "*u8", "coeffs_ptr": "*fp64",
                                 "consts_ptr": "*fp64"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.GELU_TANH, "CHEB": 25, "BLOCK_BYTES": 256,
      "ACC": tl.float64}),
    (k.grad_sums_ncs_kernel, {"z_ptr": "*bf16", "dz_ptr": "*bf16", "bits_ptr": "*u8"},
     {"HAS_BIAS": True, "ACT": k.GELU_TANH, "BRANCH": True, "NEWTON": 4, "CHEB": 16,
      "TAYLOR": True, "BLOCK_N": 2, "BLOCK_S": 1024, "ACC": F32}),
    (k.input_grad_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "dx_ptr": "*fp64",
                           "coeffs_ptr": "*fp64", "bits_ptr": "*u8", "consts_ptr": "*fp64"},
     {"CHANNEL_ON_ROWS": False, "ACT": k.GELU_TANH, "BRANCH": True, "NEWTON": 5, "CHEB": 25,
      "TAYLOR": False, "BLOCK_R": 8, "BLOCK_K": 256, "ACC": tl.float64}),
    (k.grad_sums_mc_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "bias_ptr": "*fp64",
                             "parts_ptr": "*fp64", "bits_ptr": "*u8", "consts_ptr": "*fp64"},
     {"HAS_BIAS": True, "ACT": k.MISH, "BRANCH": True, "NEWTON": 5, "CHEB": 25,
      "TAYLOR": False, "BLOCK_R": 32, "BLOCK_C": 64, "ACC": tl.float64}),
    (k.input_grad_kernel, {"bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.MISH, "BRANCH": True, "NEWTON": 4, "CHEB": 16,
      "TAYLOR": True, "BLOCK_R": 2, "BLOCK_K": 1024, "ACC": F32}),
    (k.grad_sums_ncs_kernel, {"z_ptr": "*bf16", "dz_ptr": "*bf16", "bits_ptr": "*u8"},
     {"HAS_BIAS": True, "ACT": k.ELU, **NO_BRANCH, "BLOCK_N": 2, "BLOCK_S": 1024, "ACC": F32}),
    (k.grad_sums_ncs_kernel, {"z_ptr": "*fp16", "dz_ptr": "*fp16", "bits_ptr": "*u8"},
     {"HAS_BIAS": True, "ACT": k.GELU, "BRANCH": True, "NEWTON": 4, "CHEB": 16,
      "TAYLOR": True, "BLOCK_N": 2,
      "BLOCK_S": 1024, "ACC": F32}),
    (k.grad_sums_mc_kernel, {"bits_ptr": "*u8"},
     {"HAS_BIAS": False, "ACT": k.LEAKY_RELU, **NO_BRANCH, "BLOCK_R": 32, "BLOCK_C": 64,
      "ACC": F32}),
    (k.grad_sums_mc_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "bias_ptr": "*fp64",
                             "parts_ptr": "*fp64", "bits_ptr": "*u8", "consts_ptr": "*fp64"},
     {"HAS_BIAS": True, "ACT": k.SILU, "BRANCH": True, "NEWTON": 5, "CHEB": 25,
      "TAYLOR": False,
      "BLOCK_R": 32, "BLOCK_C": 64, "ACC": tl.float64}),
    (k.finalize_backward_kernel, {},
     {"TRAINING": True, "HAS_BIAS": True, "WANT_DGAMMA": True, "WANT_DBETA": True,
      "GAMMA_ABS": True, "BLOCK_C": 128, "ACC": F32}),
    (k.input_grad_kernel, {"z_ptr": "*bf16", "dz_ptr": "*bf16", "dx_ptr": "*bf16",
                           "bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.IDENTITY, **NO_BRANCH, "BLOCK_R": 2, "BLOCK_K": 1024,
      "ACC": F32}),
    (k.input_grad_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "dx_ptr": "*fp64",
                           "coeffs_ptr": "*fp64", "bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": False, "ACT": k.ELU, **NO_BRANCH, "BLOCK_R": 16, "BLOCK_K": 128,
      "ACC": tl.float64}),
    (k.input_grad_kernel, {"bits_ptr": "*u8"},
     {"CHANNEL_ON_ROWS": False, "ACT": k.SILU, "BRANCH": True, "NEWTON": 4, "CHEB": 16,
      "TAYLOR": True,
      "BLOCK_R": 8, "BLOCK_K": 256, "ACC": F32}),
    (k.input_grad_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "dx_ptr": "*fp64",
                           "coeffs_ptr": "*fp64", "bits_ptr": "*u8", "consts_ptr": "*fp64"},
     {"CHANNEL_ON_ROWS": True, "ACT": k.GELU, "BRANCH": True, "NEWTON": 5, "CHEB": 25,
      "TAYLOR": False,
      "BLOCK_R": 2, "BLOCK_K": 1024, "ACC": tl.float64}),
    # the activations without a norm: bfloat16 through float32, and float64
    (k.activation_grad_kernel, {"z_ptr": "*bf16", "dz_ptr": "*bf16", "dx_ptr": "*bf16",
                                "bits_ptr": "*u8"},
     {"ACT": k.GELU, "NEWTON": 4, "CHEB": 16, "TAYLOR": True, "ACC": F32, "BLOCK": 2048}),
    (k.activation_grad_kernel, {"z_ptr": "*fp64", "dz_ptr": "*fp64", "dx_ptr": "*fp64",
                                "bits_ptr": "*u8", "consts_ptr": "*fp64"},
     {"ACT": k.SILU, "NEWTON": 5, "CHEB": 25, "TAYLOR": False, "ACC": tl.float64,
      "BLOCK": 2048}),
]


def signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = pointers.get(name, "*fp32")
        else:
            # a float argument's type is its annotation (tl.float64), as at a real launch
            annotated = kernel.params[kernel.arg_names.index(name)].annotation_type
            types[name] = annotated or ("fp32" if name in FLOAT_ARGS else "i32")
    return types


def main() -> None:
    builds = []
    for kernel, pointers, constexprs in CASES:
        source = ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs=constexprs)
        compiled = triton.compile(source, target=TARGET, options={"enable_fp_fusion": True})
        ptx = compiled.asm["ptx"]
        # the scalar parameters' types as the GPU receives them (a float32 one rounds a
        # float64 layer's momentum, eps or slope)
        builds.append({"kernel": kernel.fn.__name__, "cubin_bytes": len(compiled.asm["cubin"]),
                       "f32_params": ptx.count(".param .f32"),
                       "f64_params": ptx.count(".param .f64")})
    print(json.dumps(builds))


if __name__ == "__main__":
    main()
