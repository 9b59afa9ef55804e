"""The models of jaxops.models: training lowers the loss, the linen and nnx
decoders agree, jaxops and implementation="xla" agree over 20 steps, KV-cache
decoding equals the full forward, and the encoder-decoder's masks hold.

Tiny models and a module-scoped training run keep the file fast: each jitted
function is compiled once and shared."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxops.flax import linen as jlinen
from jaxops.models import data, decoder, generate, training
from jaxops.models.blocks import empty_kv_caches
from jaxops.models.config import DecoderConfig, EncoderDecoderConfig
from jaxops.models.encoder_decoder import EncoderDecoder, seq2seq_loss
from jaxops.testing import assert_close

TINY = DecoderConfig(vocab_size=data.VOCAB_SIZE, d_model=32, num_layers=2, num_heads=4,
                     num_kv_heads=2)
BATCH, SEQ_LEN, STEPS = 4, 32, 20


@pytest.fixture(scope="module")
def corpus():
  return data.stdlib_corpus(1 << 17)


@pytest.fixture(scope="module")
def variables():
  return decoder.init_params(TINY, seed=0)


def _train(config, variables, corpus, steps):
  opt = training.OptimizerConfig(total_steps=steps, warmup_steps=5)
  tx = training.make_optimizer(opt, config.implementation)
  step = training.make_train_step(config, tx)
  params = jax.tree.map(jnp.copy, variables)  # the step donates them
  batches = (data.batch_at(corpus, i * SEQ_LEN, BATCH, SEQ_LEN) for i in range(steps))
  return training.run_steps(step, params, tx.init(params), batches)


@pytest.fixture(scope="module")
def runs(corpus, variables):
  """20 training steps from the same start, with jaxops kernels and with
  implementation="xla": {implementation: (variables, opt_state, losses)}."""
  return {impl: _train(dataclasses.replace(TINY, implementation=impl),
                       variables, corpus, STEPS)
          for impl in (None, "xla")}


def test_training_lowers_the_loss(runs):
  losses = runs[None][2]
  assert np.isfinite(losses).all()
  assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


def test_jaxops_and_xla_agree_over_20_steps(runs):
  assert_close(np.array(runs[None][2]), np.array(runs["xla"][2]), atol=2e-3, rtol=2e-3)
  assert_close(runs[None][0]["params"]["embed"]["embedding"],
               runs["xla"][0]["params"]["embed"]["embedding"], atol=2e-3, rtol=2e-3)


def test_linen_and_nnx_agree(corpus, runs):
  trained = runs[None][0]
  model = decoder.DecoderLMNNX(TINY, rngs=nnx.Rngs(1))
  decoder.linen_to_nnx(trained, model)
  tokens = jnp.asarray(data.batch_at(corpus, 0, 2, SEQ_LEN))
  assert_close(model(tokens), decoder.linen_model(TINY).apply(trained, tokens),
               atol=1e-5, rtol=1e-5)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()),
                                   decoder.nnx_to_linen(model), trained))

  # The nnx flavour's cached path: prefill 8 tokens, then decode the 9th.
  full = model(tokens[:, :9])
  caches = empty_kv_caches(TINY, 2, 9)
  prefill, caches = model(tokens[:, :8], kv_caches=caches)
  step, _ = model(tokens[:, 8:9], query_offset=jnp.int32(8), kv_caches=caches)
  assert_close(jnp.concatenate([prefill, step], axis=1), full, atol=2e-5, rtol=2e-5)


def test_kv_cache_decode_equals_full_forward(corpus, runs):
  trained = runs[None][0]
  tokens = jnp.asarray(data.batch_at(corpus, 1000, 2, 15))
  full = decoder.linen_model(TINY).apply(trained, tokens)
  decoded = generate.decode_logits(trained, tokens, config=TINY, prefill_len=5)
  assert_close(decoded, full, atol=2e-5, rtol=2e-5)


def test_attention_cache_masks_the_rows_not_yet_written():
  """Without is_causal only the cache length masks: 6 rows written into a
  10-row cache must attend like the 6-row sequence."""
  mha = jlinen.MultiHeadAttention(num_heads=4, num_kv_heads=2)
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  params = mha.init(jax.random.key(1), x)
  cache = tuple(jnp.full((2, 10, 2, 4), 7.0) for _ in range(2))  # garbage past row 6
  cached, (keys, _) = mha.apply(params, x, kv_cache=cache)
  assert_close(cached, mha.apply(params, x), atol=1e-5, rtol=1e-5)
  assert (keys[:, 6:] == 7.0).all()


def test_generate_keeps_the_prompt_and_is_deterministic(runs):
  prompt = jnp.asarray([list(b"def "), list(b"for ")], jnp.int32)
  sample = lambda: generate.generate(runs[None][0], prompt, jax.random.key(3), config=TINY,
                                     num_new=12)
  first, second = sample(), sample()
  assert first.shape == (2, 16)
  np.testing.assert_array_equal(first[:, :4], prompt)
  np.testing.assert_array_equal(first, second)
  assert ((first >= 0) & (first < TINY.vocab_size)).all()


# The encoder-decoder: masks.

SEQ2SEQ = EncoderDecoderConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=4,
                               mlp_hidden=64)
SOURCE = jnp.array([[3, 4, 5, 6, 7, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9, 10]])
TARGET = jnp.array([[1, 5, 6, 7, 0, 0], [1, 5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def seq2seq():
  """(jitted apply, variables): eager flax dispatch would cost more than the math."""
  model = EncoderDecoder(SEQ2SEQ)
  return jax.jit(model.apply), jax.jit(model.init)(jax.random.key(0), SOURCE, TARGET)


def test_padding_does_not_change_the_real_tokens_outputs(seq2seq):
  apply, variables = seq2seq
  padded = apply(variables, SOURCE, TARGET)
  alone = apply(variables, SOURCE[:1, :5], TARGET[:1, :4])
  assert_close(padded[0, :4], alone[0], atol=1e-5, rtol=1e-5)


def test_look_ahead_mask_hides_future_targets(seq2seq):
  apply, variables = seq2seq
  before = apply(variables, SOURCE, TARGET)
  after = apply(variables, SOURCE, TARGET.at[:, 3:].set(2))
  assert_close(after[:, :3], before[:, :3], atol=1e-6, rtol=1e-6)
  assert not np.allclose(after[1, 3:], before[1, 3:])


def test_seq2seq_loss_ignores_padding_and_matches_xla(seq2seq):
  _, variables = seq2seq
  model = EncoderDecoder(SEQ2SEQ)
  xla = EncoderDecoder(dataclasses.replace(SEQ2SEQ, implementation="xla"))
  loss_fn = jax.jit(seq2seq_loss, static_argnums=0)
  loss = loss_fn(model, variables, SOURCE, TARGET)
  assert_close(loss, loss_fn(xla, variables, SOURCE, TARGET), atol=1e-5, rtol=1e-5)
  padded_row = loss_fn(model, variables, SOURCE[:1], TARGET[:1])
  assert_close(padded_row, loss_fn(model, variables, SOURCE[:1, :5], TARGET[:1, :4]),
               atol=1e-6, rtol=1e-6)
  grads = jax.jit(jax.grad(seq2seq_loss, argnums=1), static_argnums=0)(
      model, variables, SOURCE, TARGET)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
