"""Character-level training text every machine has offline: the installed Python
standard library's own source.

Tokens are the bytes of the files (vocabulary 256), so any text round-trips
and no vocabulary has to be built or stored. A batch is a pure function of the
data position, so a checkpoint that records the position resumes the exact
stream of batches.
"""

from __future__ import annotations

import os

import numpy as np

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
  """The bytes of the standard library's .py files, in sorted path order, up to
  ``max_bytes``; third-party packages (site-/dist-packages) are skipped.

  Args:
    max_bytes: the most bytes to read.

  Returns:
    uint8 numpy array of the bytes.

  Raises:
    RuntimeError: no ``.py`` file was found.
  """
  root = os.path.dirname(os.__file__)
  chunks, total = [], 0
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs
                        if d not in ("site-packages", "dist-packages", "__pycache__"))
    for name in sorted(files):
      if not name.endswith(".py"):
        continue
      try:
        with open(os.path.join(directory, name), "rb") as f:
          data = f.read(max_bytes - total)
      except OSError:
        continue
      chunks.append(data)
      total += len(data)
      if total >= max_bytes:
        return np.frombuffer(b"".join(chunks), np.uint8)
  if not chunks:
    raise RuntimeError(f"no .py files found under {root}")
  return np.frombuffer(b"".join(chunks), np.uint8)


def batch_at(corpus: np.ndarray, position: int, batch: int, seq_len: int) -> np.ndarray:
  """int32 [batch, seq_len + 1] windows (inputs and next-token labels).

  Row i reads at ``position + i * stride`` (wrapping), stride = corpus / batch,
  so the rows of a batch come from different files; the next batch is at
  ``position + seq_len``.

  Args:
    corpus: uint8 bytes (:func:`stdlib_corpus`).
    position: the data position of the batch.
    batch: rows.
    seq_len: tokens per row (each row holds ``seq_len + 1``).

  Returns:
    int32 ``[batch, seq_len + 1]``.

  Raises:
    ValueError: the corpus is shorter than a row.

  Examples:
    >>> from jaxops.models import data
    >>> corpus = np.frombuffer(b"hello, world! " * 10, np.uint8)
    >>> data.decode_text(data.batch_at(corpus, 0, 2, 6)[0])
    'hello, '
  """
  span = len(corpus) - seq_len - 1
  if span <= 0:
    raise ValueError(f"corpus of {len(corpus)} bytes is too short for seq_len {seq_len}")
  stride = max(span // batch, 1)
  starts = (position + stride * np.arange(batch)) % span
  return np.stack([corpus[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def decode_text(tokens) -> str:
  """The text of byte tokens (invalid UTF-8 replaced)."""
  return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")
