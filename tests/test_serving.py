"""Serving (jaxops/models/serving.py): continuous batching over a paged KV
cache (jaxops.paged_attention, paged_kv_update, jaxops.sample) and the same
scheduler over a contiguous cache. Greedy outputs must be the tokens a full
forward pass over the growing sequence picks, whatever the batching did: more
requests than slots, a page pool too small for all of them at once (requests
wait, finished ones hand their pages on), prompts longer than a prefill chunk.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops.models import decoder, serving
from jaxops.models.config import DecoderConfig

CONFIG = DecoderConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2)
# 2 slots; 12 pages of 4 tokens hold two of the longer requests, not all five.
SERVE = serving.ServeConfig(max_batch=2, page_size=4, num_pages=12, max_seq_len=48,
                            prefill_chunk=8, temperature=0.0)
PROMPT_LENGTHS = (5, 17, 3, 40, 9)
NEW_TOKENS = (4, 7, 3, 5, 6)


@pytest.fixture(scope="module")
def model():
  variables = decoder.init_params(CONFIG, 0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CONFIG.vocab_size, n).astype(np.int32) for n in PROMPT_LENGTHS]
  return variables, prompts


def _greedy_by_full_forward(variables, prompt, num_new):
  # One padded length, so one compilation: causal attention keeps the padding
  # after the sequence out of its logits.
  forward = jax.jit(decoder.linen_model(CONFIG).apply)
  tokens = np.zeros((1, SERVE.max_seq_len), np.int32)
  tokens[0, :len(prompt)] = prompt
  for length in range(len(prompt), len(prompt) + num_new):
    tokens[0, length] = int(jnp.argmax(forward(variables, tokens)[0, length - 1]))
  return list(tokens[0, len(prompt):len(prompt) + num_new])


@pytest.fixture(scope="module")
def expected(model):
  variables, prompts = model
  return [_greedy_by_full_forward(variables, p, n) for p, n in zip(prompts, NEW_TOKENS)]


@pytest.mark.parametrize("paged, implementation", [(True, None), (False, "xla")])
def test_greedy_serving_gives_the_full_forward_tokens(model, expected, paged, implementation):
  variables, prompts = model
  config = dataclasses.replace(CONFIG, implementation=implementation)
  result = serving.serve(variables, config, prompts, NEW_TOKENS, serve_config=SERVE, paged=paged)
  assert [list(o) for o in result.outputs] == expected
  assert result.new_tokens == sum(NEW_TOKENS)
  assert result.seconds > 0


def test_paged_cache_memory_follows_the_pool(model):
  variables, prompts = model
  progress = []
  paged = serving.serve(variables, CONFIG, prompts, NEW_TOKENS, serve_config=SERVE,
                        progress=lambda *a: progress.append(a))
  contiguous = serving.serve(variables, CONFIG, prompts, NEW_TOKENS, serve_config=SERVE,
                             paged=False)
  token_bytes = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 4
  assert paged.cache_bytes == SERVE.num_pages * SERVE.page_size * token_bytes
  assert contiguous.cache_bytes == SERVE.max_batch * SERVE.max_seq_len * token_bytes
  assert paged.cache_bytes < contiguous.cache_bytes
  assert 0 < paged.peak_cache_bytes <= paged.cache_bytes
  done, total, tokens, _ = progress[-1]
  assert (done, total, tokens) == (len(prompts), len(prompts), sum(NEW_TOKENS))
  assert [d for d, *_ in progress] == sorted(d for d, *_ in progress)


def test_sampled_serving_is_reproducible(model):
  variables, prompts = model
  config = dataclasses.replace(SERVE, temperature=0.8, top_k=8, top_p=0.9)
  runs = [serving.serve(variables, CONFIG, prompts, NEW_TOKENS, serve_config=config,
                        key=jax.random.key(3)) for _ in range(2)]
  assert [list(o) for o in runs[0].outputs] == [list(o) for o in runs[1].outputs]
  assert [len(o) for o in runs[0].outputs] == list(NEW_TOKENS)
  assert all(0 <= t < CONFIG.vocab_size for o in runs[0].outputs for t in o)


@pytest.mark.parametrize("prompts, new, match", [
    ([np.zeros(45, np.int32)], [4], "more than max_seq_len"),
    ([np.zeros(0, np.int32)], [4], "non-empty prompt"),
    ([np.zeros(3, np.int32)], [0], "max_new_tokens >= 1"),
    ([np.zeros(3, np.int32)], [1, 2], "one entry per prompt"),
])
def test_bad_requests(model, prompts, new, match):
  variables, _ = model
  with pytest.raises(ValueError, match=match):
    serving.serve(variables, CONFIG, prompts, new, serve_config=SERVE)


def test_requests_larger_than_the_pool_are_refused(model):
  variables, _ = model
  small = dataclasses.replace(SERVE, num_pages=2)
  with pytest.raises(ValueError, match="more pages than the pool"):
    serving.serve(variables, CONFIG, [np.zeros(9, np.int32)], [3], serve_config=small)
