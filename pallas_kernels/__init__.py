"""Pallas kernels for V4.1's attention over paged caches, one folder per kernel (docs/kernels.md,
the contract in pallas_kernels/README.md).

Design notes: pallas_kernels/README.md, "pallas_kernels/__init__.py".
"""

from pallas_kernels.compressor import compressor
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.window_attention import window_attention

__all__ = ["compressor", "indexer_topk", "sparse_attention", "window_attention"]
