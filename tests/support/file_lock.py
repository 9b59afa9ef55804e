"""One process at a time makes a cached build product; the others wait and reuse it.

The test builds (the CUDA harness, the C++ kernel tests) cache their products
on disk. ``produce`` has each written to a temporary name and renamed, so a
reader never sees half a file, and holds an flock on ``<product>.lock`` while
it checks for the product and makes it: under pytest-xdist several worker
processes may ask for the same product at once, and without the lock each
would compile it (minutes of g++ on the CI's two cores); with it the second
asker waits for the first and then finds the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Callable


@contextlib.contextmanager
def _exclusive(lock_path: Path):
  with open(lock_path, "a") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def produce(product: Path, make: Callable[[Path], None]) -> Path:
  """``product``, unless it exists (checked again under the lock) made by
  ``make(path)``, which writes it to ``path``, then renamed into place."""
  if product.exists():
    return product
  with _exclusive(product.with_name(product.name + ".lock")):
    if not product.exists():
      # Unique even so: a killed run's leftover is never mistaken for this one's.
      tmp = product.with_name(f"{product.name}.{os.getpid()}.{threading.get_ident()}.tmp")
      make(tmp)
      tmp.replace(product)
  return product
