"""2:4 structured-sparse linear layers: ``jaxops.sparse``.

::

  sparse_w = jaxops.sparse.compress(w)          # w [out, in], 2:4 along in
  w_pruned, mask = jaxops.sparse.prune_2_4(w)   # the 2 largest |w| of every 4 (ties: lower index)
  y = jaxops.sparse.linear(x, sparse_w, bias)   # x [..., in] -> [..., out]
  w_dense = jaxops.sparse.decompress(sparse_w)

The packed layout: docs/training.md, "2:4 sparse linear".
"""

from jaxops._src.sparse import SparseWeight, compress, decompress, linear, metadata_cols, prune_2_4

__all__ = ["SparseWeight", "compress", "decompress", "linear", "metadata_cols", "prune_2_4"]
