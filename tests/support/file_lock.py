"""One process at a time makes a cached build product; the others wait and reuse it.

The test builds (the CUDA harness, the C++ kernel tests) cache their products
on disk, each written to a temporary name and renamed, so a reader never sees
half a file. Under pytest-xdist several worker processes may ask for the same
product at once: without a lock each would compile it, a duplicate of minutes
of g++ on the CI's two cores. ``produce`` holds an flock on ``<product>.lock``
while it checks for the product and makes it, so the second asker waits for the
first and then finds the file.
"""

from __future__ import annotations

import contextlib
import fcntl
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


def produce(product: Path, make: Callable[[], None]) -> Path:
  """``product``, made by ``make()`` unless it exists (checked again under the lock)."""
  if product.exists():
    return product
  with _exclusive(product.with_name(product.name + ".lock")):
    if not product.exists():
      make()
  return product
