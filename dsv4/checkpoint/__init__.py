"""Checkpoints: the released safetensors format, and our own orbax format.

A released checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or an index
and the shards it names): fp8 linears with e8m0 tile scales, packed FP4 routed experts, the rest
BF16 or F32 (`dsv4.params.Storage`; the codecs are `dsv4.formats`). One module per job:
`files` reads and checks the directory, `load` builds params from it (`load_pretrained`), `save`
writes one (`save_pretrained`), `hf_config` maps our config to its ``config.json``, `shipped`
finds the checkpoints inside the package, and `orbax_format` keeps params as they are
(`save_params`, `restore_params`).
"""

from dsv4.checkpoint import files, hf_config, load, orbax_format, save, shipped
from dsv4.checkpoint.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from dsv4.checkpoint.load import engram_token_map, load_pretrained
from dsv4.checkpoint.orbax_format import restore_params, save_params
from dsv4.checkpoint.save import quantize_params_like_checkpoint, save_pretrained
from dsv4.checkpoint.shipped import SHIPPED, SHIPPED_DIR, shipped_checkpoint

# the codecs and CheckpointError live in dsv4.formats; their names here are kept for callers
from dsv4.formats import (
    CheckpointError,
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    e8m0_to_float,
    quant_fp4,
    quant_fp8,
    quant_fp8_rows,
)

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SHIPPED",
    "SHIPPED_DIR",
    "SINGLE_FILE",
    "CheckpointError",
    "dequant_fp4",
    "dequant_fp8",
    "dequant_fp8_rows",
    "e8m0_to_float",
    "engram_token_map",
    "files",
    "hf_config",
    "load",
    "load_pretrained",
    "orbax_format",
    "quant_fp4",
    "quant_fp8",
    "quant_fp8_rows",
    "quantize_params_like_checkpoint",
    "restore_params",
    "save",
    "save_params",
    "save_pretrained",
    "shipped",
    "shipped_checkpoint",
]
