"""Pallas kernels for V4.1's attention over paged caches, one folder per kernel (docs/kernels.md,
the contract in pallas_kernels/README.md).

Each entry picks its implementation by `jax.default_backend()` (TPU kernel, GPU kernel, or the
pure-jnp reference on CPU) unless told otherwise with `impl=` / `interpret=`; see `backend`.

Note: the names below are the entry *functions*; their folders are reached as modules, e.g.
`from pallas_kernels.window_attention import reference`.
"""

from pallas_kernels.compressor import compressor
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.window_attention import window_attention

__all__ = ["compressor", "indexer_topk", "sparse_attention", "window_attention"]
