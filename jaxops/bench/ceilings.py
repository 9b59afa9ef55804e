"""The two ceilings every result is read against (``python -m jaxops.bench roofline``).

Measured once per process, on the default device, with the timing method of
its platform (``timing.time_call``), and cached:

* copy bandwidth (GB/s, bytes read + bytes written): a jitted copy of a large
  float32 buffer into a donated one of the same size (XLA lowers it to one
  copy into the donated buffer, so no fresh output is faulted in on the CPU);
  1 GiB on a GPU, 256 MiB on the CPU. Bandwidth-bound kernels report the bytes
  they must move over their time as a share of it. On the CPU, XLA's copy can
  use fewer threads than a kernel, and a share above 100% is possible there.
* matmul rate (TFLOP/s, 2 n^3 per product): an n x n by n x n product in
  bfloat16 and in float32 (default precision: TF32 on a GPU), n = 8192 on a
  GPU, 2048 on the CPU; the faster of the two (bfloat16 on a GPU; on the CPU,
  XLA's float32 dot can be the faster). Compute-bound kernels (attention, the
  patch GEMM, linear cross-entropy) report their TFLOP/s as a share of it,
  whatever their dtype: the ceiling is the device's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxops.bench.timing import time_call, uses_device_timing

_COPY_BYTES = {"device": 1 << 30, "host": 256 << 20}
_MATMUL_SIZE = {"device": 8192, "host": 2048}
_RUNS = 5


@dataclasses.dataclass(frozen=True)
class Ceiling:
  value: float
  unit: str  # "GB/s" or "TFLOP/s"
  what: str  # how it was measured, in words

  def share(self, rate: float) -> float:
    return rate / self.value


def _sizes(table):
  return table["device" if uses_device_timing(jax.default_backend()) else "host"]


@functools.cache
def copy_bandwidth() -> Ceiling:
  nbytes = _sizes(_COPY_BYTES)
  source = jnp.ones((nbytes // 4,), jnp.float32)
  destination = jnp.zeros_like(source)
  t = time_call(lambda dst, src: lax.dynamic_update_slice(dst, src, (0,)), destination, source,
                runs=_RUNS, donate_argnums=(0,))
  return Ceiling(2 * nbytes / (t.ms * 1e-3) / 1e9, "GB/s",
                 f"copy of {nbytes >> 20} MiB into a donated buffer, read + write; {t.method}")


@functools.cache
def matmul_rate() -> Ceiling:
  n = _sizes(_MATMUL_SIZE)
  rates = []
  for dtype in (jnp.bfloat16, jnp.float32):
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32).astype(dtype)
            for i in range(2))
    t = time_call(jnp.matmul, a, b, runs=_RUNS)
    rates.append(Ceiling(2 * n ** 3 / (t.ms * 1e-3) / 1e12, "TFLOP/s",
                         f"{jnp.dtype(dtype).name} {n}x{n} by {n}x{n} matmul, the faster of "
                         f"bfloat16 and float32; {t.method}"))
  return max(rates, key=lambda ceiling: ceiling.value)
