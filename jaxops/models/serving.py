"""Serving the decoder LM: continuous batching over a paged KV cache.

A fixed number of batch slots run at once. Each scheduler iteration

1. admits waiting requests into free slots, giving each the pages its prompt
   and its new tokens will need (a request waits while the pool is short);
2. runs one chunked-prefill call (T = ``prefill_chunk``) for the slots still
   reading their prompt, if any, and one decode call (T = 1) for the slots
   generating; rows of other slots are padding (``query_lens`` 0);
3. samples each slot's next token with ``jaxops.sample`` from the logits of its
   last real row, and retires finished sequences, returning their pages.

So sequences of different lengths share the batch, and a finished sequence's
pages go to the next request at once. Only two shapes are ever compiled.

``serve(..., paged=False)`` runs the same scheduler over a contiguous cache (a
[max_batch, max_len] row per slot: :class:`BatchedKVCache`) — with
``implementation="xla"`` that is the jnp reference the demo compares against.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops.flax._serving_caches import BatchedKVCache, PagedKVCache
from jaxops.models.config import DecoderConfig
from jaxops.models.decoder import linen_model


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """The scheduler's sizes and the sampling parameters."""

  max_batch: int = 8          # sequences decoded together
  page_size: int = 16         # tokens per page
  num_pages: int = 64         # pages in the pool (paged cache only)
  max_seq_len: int = 256      # prompt + new tokens, per sequence
  prefill_chunk: int = 32     # prompt tokens per prefill call and sequence
  temperature: float = 0.8
  top_k: int | None = 40
  top_p: float | None = 0.95

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)


@dataclasses.dataclass
class ServeResult:
  """What :func:`serve` returns: the new tokens of each request and the measurements."""
  outputs: list[np.ndarray]   # the new tokens of each request, in request order
  new_tokens: int             # generated tokens in all
  seconds: float              # wall time of the scheduler loop (compilation excluded)
  cache_bytes: int            # bytes of the KV cache allocated
  peak_cache_bytes: int       # bytes of the cache holding tokens at the busiest step

  @property
  def tokens_per_second(self) -> float:
    return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass
class _Slot:
  request: int
  prompt: np.ndarray
  max_new: int
  pages: list[int]
  cached: int = 0                 # tokens written to the cache
  next_token: int | None = None   # sampled, not yet fed back
  generated: list[int] = dataclasses.field(default_factory=list)

  @property
  def prefilling(self) -> bool:
    return self.cached < len(self.prompt)


def _step_fn(config: DecoderConfig, paged: bool):
  """jit of one model call over all slots: (next tokens [B], updated caches)."""

  def step(variables, caches, tokens, query_lens, positions, block_tables, slot_mapping, key,
           sampling):
    kv_lens = positions[:, 0] + query_lens
    if paged:
      layers = tuple(PagedKVCache(k, v, block_tables, kv_lens, query_lens, positions,
                                  slot_mapping) for k, v in caches)
    else:
      layers = tuple(BatchedKVCache(k, v, query_lens, positions) for k, v in caches)
    logits, layers = linen_model(config).apply(variables, tokens, kv_caches=layers)
    last = jnp.take_along_axis(logits, jnp.maximum(query_lens - 1, 0)[:, None, None],
                               axis=1)[:, 0]
    temperature, top_k, top_p = sampling
    next_tokens = jaxops.sample(key, last, temperature=temperature, top_k=top_k, top_p=top_p,
                                implementation=config.implementation)
    if paged:
      return next_tokens, tuple((c.key_pages, c.value_pages) for c in layers)
    return next_tokens, tuple((c.keys, c.values) for c in layers)

  return jax.jit(step, donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def _compiled_step(config: DecoderConfig, paged: bool):
  return _step_fn(config, paged)


def empty_caches(config: DecoderConfig, serve: ServeConfig, *, paged: bool,
                 dtype=jnp.float32):
  """Zeroed (keys, values) per layer: pages [num_pages, page_size, K, H], or rows
  [max_batch, max_seq_len, K, H]."""
  if paged:
    shape = (serve.num_pages, serve.page_size, config.num_kv_heads, config.head_dim)
  else:
    shape = (serve.max_batch, serve.max_seq_len, config.num_kv_heads, config.head_dim)
  return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
               for _ in range(config.num_layers))


def _cache_bytes(caches) -> int:
  return sum(k.nbytes + v.nbytes for k, v in caches)


def _pages_needed(serve: ServeConfig, tokens: int) -> int:
  return -(-tokens // serve.page_size)


def _validate(serve: ServeConfig, prompts, max_new_tokens, paged: bool):
  op = "jaxops.models.serving.serve"
  if len(prompts) != len(max_new_tokens):
    raise ValueError(f"{op}: max_new_tokens must have one entry per prompt "
                     f"({len(prompts)}), got {len(max_new_tokens)}")
  for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens)):
    if len(prompt) < 1 or new < 1:
      raise ValueError(f"{op}: request {i} needs a non-empty prompt and max_new_tokens >= 1")
    if len(prompt) + new > serve.max_seq_len:
      raise ValueError(f"{op}: request {i} needs {len(prompt) + new} tokens, more than "
                       f"max_seq_len = {serve.max_seq_len}")
    if paged and _pages_needed(serve, len(prompt) + new) > serve.num_pages:
      raise ValueError(f"{op}: request {i} needs more pages than the pool's {serve.num_pages}")


def serve(variables, config: DecoderConfig, prompts: Sequence[np.ndarray],
          max_new_tokens: Sequence[int], *, serve_config: ServeConfig = ServeConfig(),
          key=None, paged: bool = True,
          progress: Callable[[int, int, int, float], None] | None = None,
          warmup: bool = True) -> ServeResult:
  """Generates ``max_new_tokens[i]`` tokens after each of ``prompts`` (int token
  arrays) with continuous batching; ``progress(done, total, new_tokens, seconds)``
  is called after every iteration. Returns the new tokens and the measurements.
  ``warmup`` first serves one two-token request, untimed, so that ``seconds``
  excludes compilation and first-call costs.

  Args:
    variables: the linen variables of a :class:`~jaxops.models.decoder.DecoderLM`.
    config: the model's configuration.
    prompts: one int token array per request.
    max_new_tokens: the tokens to generate for each request.
    serve_config: the scheduler's sizes and sampling parameters.
    key: a PRNG key for the sampling (default ``jax.random.key(0)``).
    paged: a paged KV cache (``jaxops.paged_attention``), or with False a
      contiguous ``[max_batch, max_seq_len]`` cache on the jnp reference path.
    progress: called as ``progress(done, total, new_tokens, seconds)``.
    warmup: serve a two-token request first, untimed.

  Returns:
    A :class:`ServeResult`.

  Raises:
    ValueError: a request has an empty prompt, asks for no token, needs more
      than ``max_seq_len`` tokens or more pages than the pool holds.
  """
  plan = serve_config
  _validate(plan, prompts, max_new_tokens, paged)
  key = jax.random.key(0) if key is None else key
  if warmup:
    serve(variables, config, [np.asarray(prompts[0])[:1]], [2], serve_config=plan,
             key=key, paged=paged, warmup=False)
  step = _compiled_step(config, paged)
  caches = empty_caches(config, plan, paged=paged)
  cache_bytes = _cache_bytes(caches)
  token_bytes = cache_bytes // (plan.num_pages * plan.page_size if paged
                                else plan.max_batch * plan.max_seq_len)
  sampling = (jnp.float32(plan.temperature), jnp.int32(plan.top_k or 0),
              jnp.float32(plan.top_p or 1.0))
  free_pages = list(range(plan.num_pages))
  slots: list[_Slot | None] = [None] * plan.max_batch
  waiting = list(range(len(prompts)))
  outputs: list[np.ndarray | None] = [None] * len(prompts)
  new_tokens = peak_tokens = 0

  def admit():
    for b in range(plan.max_batch):
      if slots[b] is not None or not waiting:
        continue
      request = waiting[0]
      total = len(prompts[request]) + max_new_tokens[request]
      needed = _pages_needed(plan, total) if paged else 0
      if needed > len(free_pages):
        return  # in order: the head of the queue waits for pages
      waiting.pop(0)
      pages = [free_pages.pop() for _ in range(needed)]
      slots[b] = _Slot(request, np.asarray(prompts[request]), max_new_tokens[request], pages)

  def run(rows: dict[int, list[int]], width: int, key):
    """One call: rows[b] = the tokens slot b feeds (the others are padding)."""
    tokens = np.zeros((plan.max_batch, width), np.int32)
    query_lens = np.zeros((plan.max_batch,), np.int32)
    positions = np.zeros((plan.max_batch, width), np.int32)
    tables = np.zeros((plan.max_batch, plan.max_pages_per_seq), np.int32)
    slot_mapping = np.full((plan.max_batch, width), -1, np.int32)
    for b, slot in enumerate(slots):
      if slot is None:
        continue
      tables[b, :len(slot.pages)] = slot.pages
      fed = rows.get(b, [])
      positions[b] = slot.cached + np.arange(width)
      query_lens[b] = len(fed)
      tokens[b, :len(fed)] = fed
      for t in range(len(fed)):
        position = slot.cached + t
        page = slot.pages[position // plan.page_size] if paged else 0
        slot_mapping[b, t] = page * plan.page_size + position % plan.page_size
    return step(variables, caches, tokens, query_lens, positions, tables,
                slot_mapping.reshape(-1), key, sampling)

  def feed(rows, sampled):
    nonlocal new_tokens
    for b, fed in rows.items():
      slot = slots[b]
      slot.cached += len(fed)
      if slot.prefilling:
        continue  # the prompt's middle: its logits predict prompt tokens
      slot.next_token = int(sampled[b])
      slot.generated.append(slot.next_token)
      new_tokens += 1
      if len(slot.generated) == slot.max_new:
        outputs[slot.request] = np.asarray(slot.generated, np.int32)
        free_pages.extend(slot.pages)
        slots[b] = None

  def iteration(key):
    nonlocal caches, peak_tokens
    admit()
    prefill = {b: list(s.prompt[s.cached:s.cached + plan.prefill_chunk])
               for b, s in enumerate(slots) if s is not None and s.prefilling}
    decode = {b: [s.next_token] for b, s in enumerate(slots)
              if s is not None and not s.prefilling and s.next_token is not None}
    prefill_key, decode_key = jax.random.split(key)
    if prefill:
      sampled, caches = run(prefill, plan.prefill_chunk, prefill_key)
      feed(prefill, np.asarray(sampled))
    if decode:  # a slot that finished its prompt above joins the next iteration's
      sampled, caches = run(decode, 1, decode_key)
      feed(decode, np.asarray(sampled))
    cached = sum(len(s.pages) * plan.page_size if paged else s.cached
                 for s in slots if s is not None)
    peak_tokens = max(peak_tokens, cached)

  start = time.perf_counter()
  while waiting or any(s is not None for s in slots):
    key, step_key = jax.random.split(key)
    iteration(step_key)
    if progress is not None:
      done = sum(o is not None for o in outputs)
      progress(done, len(prompts), new_tokens, time.perf_counter() - start)
  seconds = time.perf_counter() - start
  return ServeResult(outputs=outputs, new_tokens=new_tokens, seconds=seconds,
                     cache_bytes=cache_bytes, peak_cache_bytes=peak_tokens * token_bytes)
