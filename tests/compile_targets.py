"""Compile the cast kernels for sm_90 and sm_100 without a GPU; print what the PTX holds.

Run as a script (the kernels must be decorated without TRITON_INTERPRET). Prints one JSON
line per build: {"kernel", "cap", "variant", "ue8m0": bool, "e4m3_cvt": bool}.
"""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from mxfp8_a2a.dequantize import _dequantize_kernel  # noqa: E402
from mxfp8_a2a.quantize import _quantize_kernel  # noqa: E402
from mxfp8_a2a.roundtrip import _roundtrip_kernel  # noqa: E402

I32 = "i32"
GAP = ["n_groups", "groups_per_row", "gap_at", "gap_len"]
QUANT_SIG = dict.fromkeys(GAP + ["stride_xm", "stride_xk", "stride_dm", "stride_sm"], I32)
DEQUANT_SIG = dict.fromkeys(GAP + ["stride_dm", "stride_sm", "stride_om"], I32)
ROUNDTRIP_SIG = dict.fromkeys(GAP[:2] + ["stride_xm", "stride_xk", "stride_om"], I32)


def build(kernel, sig, constexprs, cap):
    sig = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(kernel, sig, constexprs=constexprs)
    return compile(src, target=GPUTarget("cuda", cap, 32)).asm["ptx"]


for cap in (90, 100):
    for dtype in ("bf16", "fp32"):
        for mode in ("rceil", "floor"):
            sig = {
                "x_ptr": f"*{dtype}",
                "data_ptr": "*u8",
                "scale_ptr": "*u8",
                **QUANT_SIG,
            }
            flags = {"RCEIL": mode == "rceil", "BLOCK_G": 64, "SOFT": False}
            ptx = build(
                _quantize_kernel,
                sig,
                {**flags, "HW_E8M0": cap >= 100, "INT64": mode == "rceil"},
                cap,
            )
            print(
                json.dumps(
                    {
                        "kernel": "quantize",
                        "cap": cap,
                        "variant": f"{dtype}-{mode}",
                        "ue8m0": "cvt.rp.satfinite.ue8m0x2.f32" in ptx,
                        "e4m3_cvt": "e4m3x2.f32" in ptx,
                    }
                )
            )
        sig = {
            "data_ptr": "*u8",
            "scale_ptr": "*u8",
            "out_ptr": f"*{dtype}",
            **DEQUANT_SIG,
        }
        ptx = build(
            _dequantize_kernel,
            sig,
            {"BLOCK_G": 64, "SOFT": False, "INT64": dtype == "bf16"},
            cap,
        )
        print(
            json.dumps(
                {
                    "kernel": "dequantize",
                    "cap": cap,
                    "variant": dtype,
                    "ue8m0": False,
                    "e4m3_cvt": "e4m3x2" in ptx,
                }
            )
        )
        sig = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **ROUNDTRIP_SIG}
        flags = {"RCEIL": True, "BLOCK_G": 64, "SOFT": False, "HW_E8M0": cap >= 100}
        ptx = build(_roundtrip_kernel, sig, {**flags, "INT64": False}, cap)
        print(
            json.dumps(
                {
                    "kernel": "roundtrip",
                    "cap": cap,
                    "variant": f"{dtype}-rceil",
                    "ue8m0": "cvt.rp.satfinite.ue8m0x2.f32" in ptx,
                    "e4m3_cvt": "e4m3x2.f32" in ptx and "e4m3x2" in ptx,
                }
            )
        )
