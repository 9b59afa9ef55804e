"""Runs every jaxops kernel of one CUDA source file once, against the jnp reference.

    python -P tools/gpu_smoke.py --family attention --size small
    python -P tools/gpu_smoke.py --family all

A family is named after its kernel file, ``cuda/<family>.cu``: running it
launches every kernel defined there (forward, backward and forward-mode
passes, with ``implementation="ffi"``), so that ``tools/gpu_check.sh`` can run
one family under ``compute-sanitizer`` (``--size small``: a few KiB per array,
quick under memcheck) or profile one named kernel with ``ncu`` (``--size
large``: shapes that fill an H100/H200, the family of a kernel being the file
that defines it). Each result is also compared with ``implementation="xla"``
within a loose tolerance, so a broken launch shows as a failure here and not
only in the test suite; exit status 1 names the failing checks.

It runs wherever jaxops does: on the CPU the same calls take the CPU kernels
(tests/test_gpu_check.py runs it there).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxops

CUDA_SOURCES = pathlib.Path(__file__).resolve().parent.parent / "cuda"


class Checker:
  """Runs ``fn`` with each implementation under jit and records the largest
  difference, relative to the reference's largest magnitude."""

  def __init__(self, size: str):
    self.size = size
    self.failures: list[str] = []
    self._rng = np.random.default_rng(0)

  def pick(self, small, large):
    return small if self.size == "small" else large

  def normal(self, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(self._rng.standard_normal(shape, np.float32) * scale, dtype)

  def integers(self, low, high, shape):
    return jnp.asarray(self._rng.integers(low, high, shape), jnp.int32)

  def check(self, name: str, fn, *args, tolerance=2e-2):
    """``fn(implementation, *args)`` with "ffi" against "xla": outputs (a
    pytree) within ``tolerance`` of the reference's largest magnitude, NaN
    where the reference has NaN."""
    start = time.perf_counter()
    ours = jax.block_until_ready(jax.jit(lambda *a: fn("ffi", *a))(*args))
    seconds = time.perf_counter() - start
    ref = jax.jit(lambda *a: fn("xla", *a))(*args)
    worst = 0.0
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        worst = np.inf
        break
      finite = np.isfinite(b)
      if a[finite].size:
        worst = max(worst, float(np.max(np.abs(a[finite] - b[finite]))
                                 / max(1.0, float(np.max(np.abs(b[finite]))))))
    ok = worst <= tolerance
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<44} max rel. difference {worst:.2e} "
          f"({seconds:.2f} s with compilation)", flush=True)
    if not ok:
      self.failures.append(name)


def _vjp(f, *args):
  """f's output and its VJP for a random-like cotangent (the output itself, scaled)."""
  out, pullback = jax.vjp(f, *args)
  return out, pullback(jax.tree.map(lambda o: o * 0.5 + 0.25, out))


def _jvp(f, *args):
  return jax.jvp(f, args, tuple(jax.tree.map(lambda a: a * 0.5, args)))


# -- the families, one per cuda/<family>.cu -----------------------------------------------


def norms(c: Checker):
  rows, cols = c.pick((37, 300), (8192, 4096))
  for dtype in (jnp.float32, jnp.bfloat16):
    x, r = c.normal((rows, cols), dtype), c.normal((rows, cols), dtype)
    w, b = c.normal((cols,), dtype), c.normal((cols,), dtype)
    layer = lambda impl, x, w, b: jaxops.layer_norm(x, w, b, implementation=impl)
    rms = lambda impl, x, w: jaxops.rms_norm(x, w, implementation=impl)
    add = lambda impl, x, r, w: jaxops.add_rms_norm(x, r, w, implementation=impl)
    name = jnp.dtype(dtype).name
    c.check(f"layer_norm vjp {name}", lambda i, *a: _vjp(lambda *a: layer(i, *a), *a), x, w, b)
    c.check(f"layer_norm jvp {name}", lambda i, *a: _jvp(lambda *a: layer(i, *a), *a), x, w, b)
    c.check(f"rms_norm vjp {name}", lambda i, *a: _vjp(lambda *a: rms(i, *a), *a), x, w)
    c.check(f"rms_norm jvp {name}", lambda i, *a: _jvp(lambda *a: rms(i, *a), *a), x, w)
    c.check(f"add_rms_norm vjp {name}", lambda i, *a: _vjp(lambda *a: add(i, *a), *a), x, r, w)


def softmax(c: Checker):
  rows, cols = c.pick((37, 300), (8192, 4096))
  for dtype in (jnp.float32, jnp.bfloat16):
    x = c.normal((rows, cols), dtype)
    name = jnp.dtype(dtype).name
    for op in (jaxops.softmax, jaxops.log_softmax):
      f = lambda impl, x, op=op: op(x, implementation=impl)
      c.check(f"{op.__name__} vjp {name}", lambda i, x, f=f: _vjp(lambda x: f(i, x), x), x)
      c.check(f"{op.__name__} jvp {name}", lambda i, x, f=f: _jvp(lambda x: f(i, x), x), x)
    square = c.normal((4, cols // 8, cols // 8), dtype)
    causal = lambda impl, x: jaxops.causal_softmax(x, implementation=impl)
    c.check(f"causal_softmax vjp {name}", lambda i, x: _vjp(lambda x: causal(i, x), x), square)


def cross_entropy(c: Checker):
  tokens, vocab, hidden = c.pick((37, 300, 64), (8192, 4096, 1024))
  for dtype in (jnp.float32, jnp.bfloat16):
    logits, labels = c.normal((tokens, vocab), dtype), c.integers(0, vocab, (tokens,))
    name = jnp.dtype(dtype).name
    loss = lambda impl, z: jaxops.cross_entropy(z, labels, label_smoothing=0.1,
                                                implementation=impl)
    c.check(f"cross_entropy vjp {name}", lambda i, z: _vjp(lambda z: loss(i, z), z), logits)
    c.check(f"cross_entropy jvp {name}", lambda i, z: _jvp(lambda z: loss(i, z), z), logits)
    x, w = c.normal((tokens, hidden), dtype), c.normal((hidden, vocab), dtype, hidden ** -0.5)
    linear = lambda impl, x, w: jaxops.linear_cross_entropy(x, w, labels, implementation=impl)
    c.check(f"linear_cross_entropy vjp {name}",
            lambda i, x, w: _vjp(lambda x, w: linear(i, x, w), x, w), x, w)


def activations(c: Checker):
  shape = c.pick((37, 300), (8192, 4096))
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y = c.normal(shape, dtype), c.normal(shape, dtype)
    name = jnp.dtype(dtype).name
    for op in (jaxops.gelu, jaxops.silu):
      f = lambda impl, x, op=op: op(x, implementation=impl)
      c.check(f"{op.__name__} vjp {name}", lambda i, x, f=f: _vjp(lambda x: f(i, x), x), x)
    for op in (jaxops.swiglu, jaxops.geglu):
      f = lambda impl, x, y, op=op: op(x, y, implementation=impl)
      c.check(f"{op.__name__} vjp {name}",
              lambda i, x, y, f=f: _vjp(lambda x, y: f(i, x, y), x, y), x, y)


def rope(c: Checker):
  batch, seq, heads, dim = c.pick((2, 37, 3, 64), (8, 4096, 32, 128))
  positions = jnp.arange(seq, dtype=jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = c.normal((batch, seq, heads, dim), dtype)
    for style in ("neox", "gptj"):
      f = lambda impl, x, style=style: jaxops.rope(x, positions, style=style, implementation=impl)
      c.check(f"rope {style} vjp {jnp.dtype(dtype).name}",
              lambda i, x, f=f: _vjp(lambda x: f(i, x), x), x)


def embedding(c: Checker):
  vocab, dim, tokens = c.pick((300, 64, 37), (32768, 4096, 16384))
  for dtype in (jnp.float32, jnp.bfloat16):
    table, ids = c.normal((vocab, dim), dtype), c.integers(-3, vocab + 3, (tokens,))
    f = lambda impl, t: jaxops.embedding(t, ids, implementation=impl)
    c.check(f"embedding vjp {jnp.dtype(dtype).name}",
            lambda i, t: _vjp(lambda t: f(i, t), t), table)


def adamw(c: Checker):
  sizes = c.pick((37, 300, 4099), (25_000_000, 25_000_000, 50_000_000))
  for dtype in (jnp.float32, jnp.bfloat16):
    params = {f"w{i}": c.normal((n,), dtype) for i, n in enumerate(sizes)}
    grads = {k: c.normal(v.shape, dtype, 1e-2) for k, v in params.items()}

    def update(impl, grads, params):
      tx = jaxops.optim.adamw(1e-3, weight_decay=0.01, implementation=impl)
      return tx.update(grads, tx.init(params), params)

    def step(impl, grads, params):
      tx = jaxops.optim.adamw(1e-3, weight_decay=0.01, nesterov=True, implementation=impl)
      return tx.step(grads, tx.init(params), params)

    name = jnp.dtype(dtype).name
    c.check(f"adamw update {name}", update, grads, params)
    c.check(f"adamw step (nesterov) {name}", step, grads, params)


def _attention_inputs(c: Checker, dtype):
  batch, seq, heads, kv_heads, dim = c.pick((2, 37, 4, 2, 64), (4, 4096, 16, 16, 128))
  q = c.normal((batch, seq, heads, dim), dtype)
  k, v = c.normal((batch, seq, kv_heads, dim), dtype), c.normal((batch, seq, kv_heads, dim), dtype)
  return q, k, v


def attention(c: Checker):
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v = _attention_inputs(c, dtype)
    for causal in (False, True):
      f = lambda impl, q, k, v, causal=causal: jaxops.attention(q, k, v, is_causal=causal,
                                                                implementation=impl)
      c.check(f"attention vjp causal={causal} {jnp.dtype(dtype).name}",
              lambda i, *a, f=f: _vjp(lambda *a: f(i, *a), *a), q, k, v)


def attention_decode(c: Checker):
  # One query token against a long cache: the split-K decode kernels and their merge.
  batch, seq, heads, kv_heads, dim = c.pick((3, 300, 8, 2, 64), (32, 8192, 32, 8, 128))
  for dtype in (jnp.float32, jnp.bfloat16):
    q = c.normal((batch, 1, heads, dim), dtype)
    k, v = c.normal((batch, seq, kv_heads, dim), dtype), c.normal((batch, seq, kv_heads, dim), dtype)
    f = lambda impl, q, k, v: jaxops.attention(q, k, v, is_causal=True, query_offset=seq - 1,
                                               implementation=impl)
    c.check(f"attention decode {jnp.dtype(dtype).name}", f, q, k, v)


def attention_jvp(c: Checker):
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v = _attention_inputs(c, dtype)
    f = lambda impl, q, k, v: jaxops.attention(q, k, v, is_causal=True, implementation=impl)
    c.check(f"attention jvp causal {jnp.dtype(dtype).name}",
            lambda i, *a: _jvp(lambda *a: f(i, *a), *a), q, k, v)


def paged_attention(c: Checker):
  batch, heads, kv_heads, dim, page, pages_per_seq = c.pick((3, 8, 2, 64, 16, 5),
                                                            (32, 32, 8, 128, 16, 512))
  pages = batch * pages_per_seq
  tables = jnp.arange(pages, dtype=jnp.int32).reshape(batch, pages_per_seq)
  kv_lens = jnp.asarray(np.linspace(1, pages_per_seq * page, batch).astype(np.int32))
  for dtype in (jnp.float32, jnp.bfloat16):
    k_pages = c.normal((pages, page, kv_heads, dim), dtype)
    v_pages = c.normal((pages, page, kv_heads, dim), dtype)
    query = c.normal((batch, heads, dim), dtype)
    new_k, new_v = c.normal((batch, kv_heads, dim), dtype), c.normal((batch, kv_heads, dim), dtype)
    slots = tables[:, 0] * page

    def update_then_attend(impl, k_pages, v_pages, query):
      k_pages, v_pages = jaxops.paged_kv_update(k_pages, v_pages, new_k, new_v, slots,
                                                implementation=impl)
      return jaxops.paged_attention(query, k_pages, v_pages, tables, kv_lens,
                                    implementation=impl)

    c.check(f"paged_kv_update + paged_attention {jnp.dtype(dtype).name}", update_then_attend,
            k_pages, v_pages, query)


def patch_embed(c: Checker):
  batch, side, channels, patch, dim = c.pick((2, 32, 3, 16, 48), (64, 224, 3, 16, 768))
  for dtype in (jnp.float32, jnp.bfloat16):
    images = c.normal((batch, side, side, channels), dtype)
    kernel = c.normal((patch, patch, channels, dim), dtype, (patch * patch * channels) ** -0.5)
    bias, cls = c.normal((dim,), dtype), c.normal((dim,), dtype)
    f = lambda impl, im, ke, b, t: jaxops.patch_embed(im, ke, b, patch_size=patch, cls_token=t,
                                                      implementation=impl)
    c.check(f"patch_embed vjp {jnp.dtype(dtype).name}",
            lambda i, *a: _vjp(lambda *a: f(i, *a), *a), images, kernel, bias, cls)


def routing(c: Checker):
  tokens, experts, k = c.pick((37, 40, 4), (16384, 128, 8))
  for dtype in (jnp.float32, jnp.bfloat16):
    logits = c.normal((tokens, experts), dtype)
    for score in ("softmax", "sigmoid"):
      f = lambda impl, z, score=score: jaxops.topk_router(z, k, score=score,
                                                          implementation=impl)[0]
      c.check(f"topk_router {score} vjp {jnp.dtype(dtype).name}",
              lambda i, z, f=f: _vjp(lambda z: f(i, z), z), logits)


def sampling(c: Checker):
  rows, vocab = c.pick((5, 300), (64, 128256))
  logits = c.normal((rows, vocab), jnp.float32, 3.0)
  key = jax.random.key(0)
  # The same key gives the same token as the jnp reference (tests/test_sampling.py).
  c.check("sample top_k/top_p", lambda impl, z: jaxops.sample(key, z, temperature=0.8, top_k=50,
                                                              top_p=0.9, implementation=impl),
          logits, tolerance=0.0)


def sparse(c: Checker):
  rows, inputs, outputs = c.pick((37, 64, 48), (8192, 4096, 4096))
  for dtype in (jnp.float32, jnp.bfloat16):
    w, _ = jaxops.sparse.prune_2_4(c.normal((outputs, inputs), dtype, inputs ** -0.5))
    sparse_w = jaxops.sparse.compress(w)
    x, bias = c.normal((rows, inputs), dtype), c.normal((outputs,), dtype)
    f = lambda impl, x, b: jaxops.sparse.linear(x, sparse_w, b, implementation=impl)
    c.check(f"sparse.linear vjp {jnp.dtype(dtype).name}",
            lambda i, x, b: _vjp(lambda x, b: f(i, x, b), x, b), x, bias)


FAMILIES = {f.__name__: f for f in (
    activations, adamw, attention, attention_decode, attention_jvp, cross_entropy, embedding,
    norms, paged_attention, patch_embed, rope, routing, sampling, softmax, sparse)}


# Kernel files that belong to another file's family: cuda/attention.cu's entry
# points launch the tensor-core kernels (forward, backward) and the SIMT ones,
# which the attention family checks.
PART_OF = {"attention_forward": "attention", "attention_backward": "attention",
           "attention_simt": "attention", "attention_forward_sm90": "attention"}


def _kernel_sources() -> list[pathlib.Path]:
  return sorted(p for p in CUDA_SOURCES.glob("*.cu") if "__global__" in p.read_text())


def kernel_files() -> list[str]:
  """The families the CUDA sources define: every cuda/*.cu holding a kernel
  (those of PART_OF under their family's name)."""
  return sorted({PART_OF.get(p.stem, p.stem) for p in _kernel_sources()})


def family_of_kernel(kernel: str) -> str | None:
  """The family (the file, or the family it is PART_OF) that defines the CUDA
  kernel ``kernel``."""
  for source in _kernel_sources():
    text = source.read_text()
    if f" {kernel}(" in text or f"\n{kernel}(" in text:
      return PART_OF.get(source.stem, source.stem)
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--family", nargs="+", default=["all"],
                      choices=["all", *FAMILIES], help="cuda/<family>.cu to run (default: all)")
  parser.add_argument("--size", choices=["small", "large"], default="small")
  parser.add_argument("--family-of-kernel", metavar="KERNEL",
                      help="print the family that defines KERNEL and exit (2: none does)")
  args = parser.parse_args(argv)
  if args.family_of_kernel:
    family = family_of_kernel(args.family_of_kernel)
    print(family or f"no cuda/*.cu defines a kernel named {args.family_of_kernel}")
    return 0 if family else 2
  chosen = list(FAMILIES) if "all" in args.family else args.family
  checker = Checker(args.size)
  print(f"# gpu_smoke on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"size {args.size}", flush=True)
  for name in chosen:
    print(f"{name}:", flush=True)
    FAMILIES[name](checker)
  if checker.failures:
    print(f"FAILED: {', '.join(checker.failures)}")
    return 1
  print(f"all {len(chosen)} families agree with the reference")
  return 0


if __name__ == "__main__":
  sys.exit(main())
