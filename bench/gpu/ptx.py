"""Part `ptx` (CPU too): the update kernel's PTX has IEEE division (div.rn.f32, no
div.approx/div.full), no FMA contraction and a NaN test before the clamp. On CUDA the PTX
of the variants actually launched here (fp32/fp16/bf16 model outputs, from the JIT
function's kernel cache); on CPU compiled for sm_90 with the launch's options."""
from __future__ import annotations

import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .engine_internals import NUM_COEFS, update_kernel_jit, update_kernel_launch_options, update_slots_triton
from .kernel_cases import random_inputs
from .report import check, row


def ptx_checks(case: str, ptx: str, note: str = "") -> None:
    n = ptx.count
    check("ptx", case, "div.rn.f32 (IEEE division)", n("div.rn.f32"), n("div.rn.f32") > 0)
    check("ptx", case, "div.approx / div.full", n("div.approx") + n("div.full"), n("div.approx") + n("div.full") == 0)
    check("ptx", case, "fma.rn.f32 (contracted)", n("fma.rn.f32"), n("fma.rn.f32") == 0)
    nan_tests = n("setp.nan.f32") + n("setp.neu.f32") + n("max.NaN.f32")
    check("ptx", case, "NaN test before the clamp", nan_tests, nan_tests > 0, note)


def launched_kernels(fn) -> list:
    """The compiled variants a Triton JIT function holds after its launches in this process
    (`device_caches[device][0]` is the kernel cache from Triton 3.2 on; `cache` before)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return [k for entry in caches.values() for k in entry[0].values()]
    return [k for per_device in getattr(fn, "cache", {}).values() for k in per_device.values()]


def run(args) -> None:
    fn = update_kernel_jit()
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        row("ptx", "sm_90", "compile", "interpreter", "skipped", "TRITON_INTERPRET is set")
        return
    if torch.cuda.is_available():  # the PTX of the kernels the update actually launched here, with its own options
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            update_slots_triton(**random_inputs(8, (4, 8, 8), dtype, seed=11))
        torch.cuda.synchronize()
        launched = [k for k in launched_kernels(fn) if "ptx" in getattr(k, "asm", {})]
        major, minor = torch.cuda.get_device_capability()
        check("ptx", f"launched on sm_{major}{minor}", "compiled variants", len(launched), len(launched) > 0,
              "from the JIT function's kernel cache")
        for k, compiled in enumerate(launched):
            ptx_checks(f"launched variant {k}, sm_{major}{minor}", compiled.asm["ptx"])
        return
    sig = {"out_ptr": "*fp16", "x_ptr": "*fp32", "h_ptr": "*fp32", "noise_ptr": "*fp32", "index_ptr": "*i32",
           "coef_ptr": "*fp32", "numel": "i32", "out_stride": "i64", "x_stride": "i64", "h_stride": "i64",
           "noise_stride": "i64", "NUM_COEFS": "constexpr", "BLOCK": "constexpr"}
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs={"NUM_COEFS": NUM_COEFS, "BLOCK": 1024}),
                              target=GPUTarget("cuda", 90, 32), options=update_kernel_launch_options())
    ptx_checks(f"sm_90, {update_kernel_launch_options()}", compiled.asm["ptx"],
               f"compiled in {time.perf_counter() - t0:.1f} s")
