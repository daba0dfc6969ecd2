"""Compile the cast and per-group kernels for sm_90 and sm_100 without a GPU; print what
the PTX holds.

Run as a script (the kernels must be decorated without TRITON_INTERPRET). Prints one JSON
line per build: {"kernel", "cap", "variant", "ue8m0": bool, "e4m3_cvt": bool}, plus
"v4_loads": bool (16-byte loads: ld.global.v4, or cp.async of 16 bytes where a loop is
software-pipelined) and "maxnreg": int (the PTX register cap, 0 if none) for
the per-group kernels, "v4_stores": bool (16-byte stores of the e4m3 data) for the static
path's scatter encoder storing through the push transport's address table.
"""

import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from mxfp8_a2a import _config  # noqa: E402
from mxfp8_a2a.formats.dequantize import _dequantize_kernel  # noqa: E402
from mxfp8_a2a.formats.quantize import _quantize_kernel  # noqa: E402
from mxfp8_a2a.formats.roundtrip import _roundtrip_kernel  # noqa: E402
from mxfp8_a2a.grouped.kernels import _row_block_kernel  # noqa: E402
from mxfp8_a2a.grouped.kernels_colwise import _amax_kernel, _cast_kernel  # noqa: E402
from mxfp8_a2a.grouped.row_scales import _row_scales_kernel  # noqa: E402
from mxfp8_a2a.grouped.weight_scales import _weight_rows_kernel  # noqa: E402
from mxfp8_a2a.moe.row_kernels import _scatter_encode_kernel, _tile  # noqa: E402

I32 = "i32"
GAP = ["n_groups", "groups_per_row", "gap_at", "gap_len"]
QUANT_SIG = dict.fromkeys(GAP + ["stride_xm", "stride_xk", "stride_dm", "stride_sm"], I32)
DEQUANT_SIG = dict.fromkeys(GAP + ["stride_dm", "stride_sm", "stride_om"], I32)
ROUNDTRIP_SIG = dict.fromkeys(GAP[:2] + ["stride_xm", "stride_xk", "stride_om"], I32)


CP_ASYNC_16 = re.compile(
    r"cp\.async\.(?:ca|cg)\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|16)\b"
)
# the static path's scatter encoder storing through an address table (PUSH: the push transport)
PUSH_SIG = {"x_ptr": "*bf16", "rows_of_ptr": "*i64", "buf_ptr": "*i64"}
PUSH_SIG |= dict.fromkeys(["n_tokens", "hidden", "stride_x", "row_stride", "cap"], I32)
# what a launch specializes as multiples of 16 (H % 32 == 0, wire rows of 16n bytes)
PUSH_ALIGNED = ["x_ptr", "rows_of_ptr", "buf_ptr", "hidden", "stride_x", "row_stride"]
PER_GROUP_ARGS = ["x_ptr", "offs_ptr", "scale_ptr", "data_ptr", "n_other", "extent"]
PER_GROUP_ARGS += ["n_groups", "sxo", "sxg", "sdo", "sdg"]


def build(kernel, sig, constexprs, cap, aligned=(), num_warps=4, maxnreg=0):
    """PTX of ``kernel``; ``aligned``: argument names Triton would see as multiples of 16;
    ``maxnreg``: the register cap the launcher gives it (0: none)."""
    sig = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(list(sig).index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return compile(src, target=GPUTarget("cuda", cap, 32), options=options).asm["ptx"]


def per_group_sig(dtype):
    sig = dict.fromkeys(PER_GROUP_ARGS, I32)
    sig.update(x_ptr=f"*{dtype}", offs_ptr="*i32", scale_ptr="*fp32", data_ptr="*u8")
    return sig


def per_group_builds(cap):
    """The rowwise kernel (row-major x, bf16 with 32- and 64-bit offsets, fp32) and the
    colwise kernels, with the GPU tilings and the strides the benchmarks give them."""
    tile = _config.ROWWISE_TILING
    for dtype, int64, block in (("bf16", False, 64), ("bf16", True, 1), ("fp32", False, 16)):
        sig = per_group_sig(dtype)
        consts = {"sxg": 1, "sdg": 1, "ROUND_POW2": False, "SOFT": False, "INT64": int64}
        consts |= {"ALIGN": 16, "BLOCK": block, "TILE": tile.tile}
        consts |= {"MIN_GROUP": tile.min_group, "N_CLASSES": tile.n_classes}
        aligned = PER_GROUP_ARGS[:6] + ["sxo", "sdo"]
        ptx = build(_row_block_kernel, sig, consts, cap, aligned, tile.num_warps, tile.maxnreg)
        yield "per_group_rowwise", f"{dtype}-{'int64' if int64 else 'int32'}", ptx
    col = _config.COLWISE_TILING
    common = {"SOFT": False, "INT64": False, "BO": col.block_other, "SUB": col.sub, "BG": 64}
    names = ["x_ptr", "offs_ptr", "ws_ptr", "n_other", "extent", "n_groups", "sxb", "sxo", "sxg"]
    sig = dict.fromkeys(names + ["n_strips"], I32)
    sig.update(x_ptr="*bf16", offs_ptr="*i32", ws_ptr="*i32")
    consts = {"sxo": 1, "BL": col.amax_rows, "ALIGN": 1, "STAGES": col.amax_stages or None}
    consts |= common
    aligned = ["x_ptr", "offs_ptr", "ws_ptr", "n_other", "extent", "sxb", "sxg"]
    ptx = build(_amax_kernel, sig, consts, cap, aligned, col.num_warps)
    yield "per_group_colwise_amax", "bf16", ptx
    names = ["x_ptr", "offs_ptr", "ws_ptr", "scale_ptr", "data_ptr", "pad_ptr", "n_other"]
    names += ["extent", "n_groups", "dest_extent", "sxb", "sxo", "sxg", "sdb", "sdo", "sdg"]
    sig = dict.fromkeys(names + ["n_strips", "n_chunks"], I32)
    sig.update(x_ptr="*bf16", offs_ptr="*i32", ws_ptr="*i32", scale_ptr="*fp32")
    sig.update(data_ptr="*u8", pad_ptr="*i32")
    # the grad_w operand: row-major x, transposed padded data
    consts = {"sxo": 1, "sdg": 1, "ROUND_POW2": True, "PAD": True, "BL": col.cast_rows}
    consts |= {"ALIGN": 16, "STAGES": col.cast_stages or None, "INVERSE": True, **common}
    aligned = names[:7] + ["dest_extent", "sxb", "sxg", "sdb", "sdo"]
    ptx = build(_cast_kernel, sig, consts, cap, aligned, col.num_warps)
    yield "per_group_colwise_cast", "bf16", ptx
    # per-row scales of a row-major [R, 2048] (the MoE benchmark's narrower operands)
    names = ["x_ptr", "data_ptr", "scale_ptr", "n_rows", "n_cols", "sxr", "sxc"]
    sig = dict.fromkeys(names, I32) | {"x_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*fp32"}
    consts = {"sxc": 1, "ROUND_POW2": False, "SOFT": False, "INT64": False, "INVERSE": True}
    consts |= {"BLOCK_R": _config.ROW_SCALES_TILE // 2048, "BLOCK_C": 2048}
    aligned = ["x_ptr", "data_ptr", "scale_ptr", "n_cols", "sxr"]
    ptx = build(_row_scales_kernel, sig, consts, cap, aligned, _config.ROW_SCALES_NUM_WARPS)
    yield "per_group_row_scales", "bf16", ptx
    # both copies of a [E, 7168, 2048] weight: its row kernel
    names = ["w_ptr", "data_ptr", "scale_ptr", "ws_ptr", "k", "n", "rows"]
    sig = dict.fromkeys(names, I32) | {"w_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*fp32"}
    sig["ws_ptr"] = "*i32"
    consts = {"SOFT": False, "INT64": False, "INVERSE": True, "BLOCK_C": 2048}
    consts |= {"BLOCK_R": _config.ROW_SCALES_TILE // 2048}
    consts["STAGES"] = _config.WEIGHT_SCALES_STAGES or None
    aligned = ["w_ptr", "data_ptr", "scale_ptr", "ws_ptr", "k", "n", "rows"]
    ptx = build(_weight_rows_kernel, sig, consts, cap, aligned, _config.WEIGHT_SCALES_NUM_WARPS)
    yield "per_group_weight_rows", "bf16", ptx


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
    bt, nb, w = _tile(7168, 4096, True, False)
    push_consts = {"K": 8, "MX": True, "RCEIL": True, "HW_E8M0": cap >= 100, "SOFT": False}
    push_consts |= {"BLOCK_T": bt, "NB": nb, "W": w, "PUSH": True}
    ptx = build(_scatter_encode_kernel, PUSH_SIG, push_consts, cap, PUSH_ALIGNED,
                _config.STATIC_ROWS_NUM_WARPS)  # fmt: skip
    print(
        json.dumps(
            {
                "kernel": "push",
                "cap": cap,
                "variant": "bf16-rceil",
                "ue8m0": "cvt.rp.satfinite.ue8m0x2.f32" in ptx,
                "e4m3_cvt": "e4m3x2" in ptx,
                "v4_stores": "st.global.v4.b32" in ptx,
            }
        )
    )
    for name, variant, ptx in per_group_builds(cap):
        print(
            json.dumps(
                {
                    "kernel": name,
                    "cap": cap,
                    "variant": variant,
                    "ue8m0": False,
                    "e4m3_cvt": "e4m3x2" in ptx,
                    "v4_loads": "ld.global.v4.b32" in ptx or bool(CP_ASYNC_16.search(ptx)),
                    "maxnreg": int(m.group(1)) if (m := re.search(r"\.maxnreg (\d+)", ptx)) else 0,
                }
            )
        )
