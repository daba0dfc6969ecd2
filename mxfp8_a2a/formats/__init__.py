"""MXFP8 formats: the casts (Triton kernels and their plain-torch references), the packed
wire layout, and the bit math the kernels share."""

from .dequantize import dequantize, dequantize_packed, dequantize_reference
from .packing import pack, packed_row_bytes, unpack
from .quantize import quantize, quantize_packed, quantize_reference
from .roundtrip import quantize_dequantize, quantize_dequantize_reference

__all__ = [
    "dequantize",
    "dequantize_packed",
    "dequantize_reference",
    "pack",
    "packed_row_bytes",
    "quantize",
    "quantize_dequantize",
    "quantize_dequantize_reference",
    "quantize_packed",
    "quantize_reference",
    "unpack",
]
