"""The released checkpoint's number formats: what sits below the params in the model's layers.

`codecs` encodes and decodes fp8 / FP4 / Engram-table bytes in numpy (loading, saving,
`dsv4.qweights.quantise_params`), with the one table of bytes per safetensors dtype;
`quantised` keeps those formats on device (`QuantisedWeight`, decoded inside jit); `host_table`
keeps an Engram table in host memory (`HostTable`).
"""

from dsv4.formats.codecs import (
    DTYPE_BYTES,
    E8M0_BIAS,
    FP4_GROUP,
    FP4_MAX,
    FP8_MAX,
    MAX_LISTED,
    CheckpointError,
    check_e4m3,
    check_e8m0,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    e8m0_to_float,
    format_problems,
    quant_fp4,
    quant_fp8,
    quant_fp8_rows,
)
from dsv4.formats.host_table import HostTable
from dsv4.formats.quantised import FORMATS, QuantisedWeight, stored_shapes, unpack_e2m1

__all__ = [
    "DTYPE_BYTES",
    "E8M0_BIAS",
    "FORMATS",
    "FP4_GROUP",
    "FP4_MAX",
    "FP8_MAX",
    "MAX_LISTED",
    "CheckpointError",
    "HostTable",
    "QuantisedWeight",
    "check_e4m3",
    "check_e8m0",
    "dequant_fp4",
    "dequant_fp8",
    "dequant_fp8_rows",
    "e8m0_to_float",
    "format_problems",
    "quant_fp4",
    "quant_fp8",
    "quant_fp8_rows",
    "stored_shapes",
    "unpack_e2m1",
]
