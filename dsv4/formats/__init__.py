"""The released checkpoint's number formats: what sits below the params in the model's layers.

`codecs` encodes and decodes fp8 / FP4 / Engram-table bytes in numpy (loading, saving,
`dsv4.qweights.quantise_params`), with the one table of bytes per safetensors dtype;
`quantised` keeps those formats on device (`QuantisedWeight`, decoded inside jit); `host_table`
keeps an Engram table in host memory (`HostTable`).
"""

from dsv4.formats import codecs
from dsv4.formats.codecs import *  # noqa: F403  (its whole public API, listed in codecs.__all__)
from dsv4.formats.host_table import HostTable
from dsv4.formats.quantised import FORMATS, QuantisedWeight, stored_shapes, unpack_e2m1

__all__ = [
    *codecs.__all__,
    "FORMATS",
    "HostTable",
    "QuantisedWeight",
    "stored_shapes",
    "unpack_e2m1",
]
