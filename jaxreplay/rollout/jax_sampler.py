"""The `jax` rollout backend: batched sampling with the KV-cache decoder of `jaxreplay.models`.

Sampling order (vLLM's, `vllm/v1/sample/sampler.py`): temperature, then top-k, then top-p.
  1. logits / temperature;
  2. top-k: keep the tokens whose tempered logit is >= the k-th largest (ties at the k-th value
     are all kept, as in vLLM);
  3. top-p (nucleus) on the distribution left after top-k: keep the smallest prefix of tokens, in
     decreasing probability, whose cumulative probability is >= top_p; the most likely token is
     always kept. Tokens tied with the least likely kept token are kept too, so the filter does not
     depend on how a sort orders equal values (vLLM's own tie-break is its sort order; the two agree
     whenever the boundary probability is not tied).
Removed tokens get logit -inf; the sampling distribution is softmax of what remains.

Log-probs. Each sampled token carries its log-prob under the distribution it was actually drawn
from, after temperature, top-k and top-p ("processed" log-probs, vLLM's
`logprobs_mode="processed_logprobs"`): that is the behaviour policy pi_old of the importance ratio.
Temperature < 1e-5 (vLLM's `_SAMPLING_EPS`) means greedy: the argmax of the raw logits, with
log-prob 0.0 (the greedy policy puts all its mass on that token).
"""
from __future__ import annotations

import functools
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import decode
from jaxreplay.models import hf_io
from jaxreplay.models.logprobs import filter_logits  # the one definition, shared with the trainer
from jaxreplay.rollout.base import (GREEDY_EPS, Completion, Group, SamplingParams, TurnDriver,
                                    Weights, check_prompts)


# ---- pure sampling math -------------------------------------------------------------------------


def _record_token(step, tok, lp, done, out_t, out_lp, num, stopped, *, stop_ids, limits=None):
  """One decode step's bookkeeping: rows not done record token `tok` [B] and its log-prob `lp` [B]
  at column `step` of out_t / out_lp [B, max_new] and count it in num [B]; a stop token ends its
  row (stopped [B]), as does reaching its token limit (`limits` [B], when given). Returns (done,
  out_t, out_lp, num, stopped)."""
  live = ~done
  out_t = out_t.at[:, step].set(jnp.where(live, tok, 0))
  out_lp = out_lp.at[:, step].set(jnp.where(live, lp, 0.0))
  hit = live & jnp.isin(tok, stop_ids)
  num = num + live.astype(jnp.int32)
  done = done | hit if limits is None else done | hit | (num >= limits)
  return done, out_t, out_lp, num, stopped | hit


def sample_token(rng: jax.Array, logits: jax.Array, temperature, top_k=None, top_p=None):
  """Draws one token per row and returns its processed log-prob.

  Args:
    rng: one PRNG key (noise for all rows from it) or a key array of shape [B] (one per row);
      typed keys (`jax.random.key`) or raw uint32 keys (`jax.random.PRNGKey`).
    logits: float [B, V] raw model logits.
    temperature: float scalar or [B]; rows with temperature < 1e-5 are greedy.
    top_k, top_p: as in `filter_logits` (None disables the filter for all rows).
  Returns:
    tokens int32 [B]; logprobs float32 [B]: log-prob of each token under the distribution it was
    sampled from (after temperature, top-k, top-p); 0.0 for greedy rows.
  """
  if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy = temperature < GREEDY_EPS
  safe_t = jnp.where(greedy, 1.0, temperature)
  filtered = filter_logits(logits, safe_t, top_k, top_p)
  if rng.ndim == 0:
    gumbel = jax.random.gumbel(rng, filtered.shape, jnp.float32)
  else:
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[-1:], jnp.float32))(rng)
  sampled = jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)  # Gumbel-max: exact
  logp = jax.nn.log_softmax(filtered, axis=-1)
  sampled_lp = jnp.take_along_axis(logp, sampled[:, None], axis=-1)[:, 0]
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  tokens = jnp.where(greedy, argmax, sampled)
  return tokens, jnp.where(greedy, 0.0, sampled_lp).astype(jnp.float32)


# ---- the batched generation loop ----------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "cache_len", "max_new", "use_top_k",
                                             "use_top_p"))
def generate_batch(cfg, params, tokens, lengths, valid, row_keys, temperature, top_k, top_p,
                   stop_ids, max_tokens, *, cache_len: int, max_new: int, use_top_k: bool,
                   use_top_p: bool):
  """Prefill, then up to `max_tokens - 1` decode steps, stopping early once every row is done.

  Args:
    cfg: ModelConfig (static); params: its parameter pytree.
    tokens: int32 [B, Lp] right-padded prompts; lengths: int32 [B] prompt lengths (>= 1).
    valid: bool [B]; False rows are batch padding, done from the start.
    row_keys: typed PRNG keys [B]; step t of row b draws with fold_in(row_keys[b], t).
    temperature, top_p: float32 scalars; top_k: int32 scalar (used when use_top_k / use_top_p).
    stop_ids: int32 [S] token ids that end a row (kept in its output); -1 entries match nothing.
    max_tokens: int32 scalar, 1 <= max_tokens <= max_new: the tokens a row may generate.
    cache_len: KV-cache length >= lengths + max_tokens - 1 (static); max_new: the output buffer
      length (static), so one compilation serves every max_tokens up to it.
  Returns:
    out_tokens int32 [B, max_new] (0 after a row's end), out_logprobs float32 [B, max_new]
    (processed log-probs, 0 after the end), num_tokens int32 [B], stopped bool [B] (a stop token
    ended the row, else max_tokens was reached).
  """
  b = tokens.shape[0]
  k = top_k if use_top_k else None
  p = top_p if use_top_p else None

  def sample(step, logits):
    keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
    return sample_token(keys, logits, temperature, k, p)

  record = functools.partial(_record_token, stop_ids=stop_ids)

  cache = decode.init_cache(cfg, b, cache_len)
  logits, cache = decode.prefill(cfg, params, tokens, lengths, cache)
  tok, lp = sample(0, logits)
  state = record(0, tok, lp, ~valid, jnp.zeros((b, max_new), jnp.int32),
                 jnp.zeros((b, max_new), jnp.float32), jnp.zeros((b,), jnp.int32),
                 jnp.zeros((b,), bool))

  def cond(carry):
    step, _, _, done = carry[:4]
    return (step < max_tokens) & ~jnp.all(done)

  def body(carry):
    step, tok, cache, *rest = carry
    logits, cache = decode.decode_step(cfg, params, tok, cache)
    tok, lp = sample(step, logits)
    return (step + 1, tok, cache, *record(step, tok, lp, *rest))

  carry = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, cache, *state))
  _, _, _, _, out_t, out_lp, num, stopped = carry
  return out_t, out_lp, num, stopped


# ---- multi-turn: one policy turn from a filled cache, observations appended by prefill ----------

_prefill = jax.jit(decode.prefill, static_argnums=0, donate_argnums=4)
_extend = jax.jit(decode.extend, static_argnums=0, donate_argnums=4)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "use_top_k", "use_top_p"),
                   donate_argnames=("cache",))
def decode_turn(cfg, params, cache, logits, active, row_keys, turn, temperature, top_k, top_p,
                stop_ids, limits, *, max_new: int, use_top_k: bool, use_top_p: bool):
  """One policy turn of every active row, from `logits` [B, V] (after the row's last token; the
  cache holds every token before it): up to limits[b] tokens, stopping at a stop id.

  Step t of turn k of row b draws with fold_in(fold_in(row_keys[b], k), t). Rows that are done
  stay frozen (their cache length does not move), so after the turn row b's cache holds its
  tokens before the turn plus the first num[b] - 1 of the turn: the last sampled token is not in
  it (the next `extend` appends it, then the observation).
  Returns out_tokens int32 [B, max_new], out_logprobs float32 [B, max_new], num int32 [B],
  stopped bool [B], the cache.
  """
  b = logits.shape[0]
  k = top_k if use_top_k else None
  p = top_p if use_top_p else None
  turn_keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, turn)

  def sample(step, logits):
    keys = jax.vmap(jax.random.fold_in, (0, None))(turn_keys, step)
    return sample_token(keys, logits, temperature, k, p)

  record = functools.partial(_record_token, stop_ids=stop_ids, limits=limits)

  tok, lp = sample(0, logits)
  state = record(0, tok, lp, ~active | (limits < 1), jnp.zeros((b, max_new), jnp.int32),
                 jnp.zeros((b, max_new), jnp.float32), jnp.zeros((b,), jnp.int32),
                 jnp.zeros((b,), bool))

  def cond(carry):
    step, _, _, done = carry[:4]
    return (step < max_new) & ~jnp.all(done)

  def body(carry):
    step, tok, cache, done, *rest = carry
    frozen = cache.lengths
    logits, cache = decode.decode_step(cfg, params, tok, cache)
    cache = cache._replace(lengths=jnp.where(done, frozen, cache.lengths))
    tok, lp = sample(step, logits)
    return (step + 1, tok, cache, *record(step, tok, lp, done, *rest))

  carry = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, cache, *state))
  _, _, cache, _, out_t, out_lp, num, stopped = carry
  return out_t, out_lp, num, stopped, cache


def output_bucket(max_tokens: int, smallest: int = 8) -> int:
  """The output-buffer length compiled for `max_tokens`: the next power of two >= it (>= 8)."""
  b = smallest
  while b < max_tokens:
    b *= 2
  return b


def default_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` below `max_len`, then `max_len` itself."""
  buckets, b = [], smallest
  while b < max_len:
    buckets.append(b)
    b *= 2
  return tuple(buckets) + (max_len,)


class JaxSampler:
  """A `RolloutWorker` that samples with the model's own JAX forward and KV cache.

  All `len(prompts) * n` rows of a `generate` call are sorted by prompt length and cut into
  batches of exactly `batch_size` rows (the last one padded), each prompt right-padded to the
  smallest bucket that holds its batch; the jitted loop so compiles once per (prompt bucket,
  `output_bucket(max_tokens)`, which of top-k / top-p are on) and every batch reuses it;
  temperature, top_k, top_p, stop ids and max_tokens are traced values. Row r of the call
  (prompt r // n, sample r % n) draws its noise from fold_in(seed, sampling.seed, call index, r)
  alone, so its tokens do not depend on the other rows of its batch (nor on `batch_size`, up to
  the float rounding of differently shaped batches). `generate_requests` samples several requests
  in one call, each with its own call index: a request gets the completions of its own `generate`
  call, and the rows of all of them fill the batches together (one padded batch, not one each).

  Weights are read once per `generate` call under a lock, so a concurrent `load_weights` never mixes
  two policies in one call, and every Group carries the version that produced it.
  """

  def __init__(self, cfg, params, max_len: int, batch_size: int = 64,
               eos_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
               policy_version: int = 0, prompt_buckets: Optional[Sequence[int]] = None,
               load_dtype=jnp.float32):
    """
    Args:
      cfg: ModelConfig; params: its parameter pytree (any sharding; jit follows it).
      max_len: the most tokens (prompt + completion) a row may hold.
      batch_size: rows per jitted batch.
      eos_token_ids: ids that always end a completion, on top of `SamplingParams.stop_token_ids`;
        None means (cfg.eos_token_id,) when it is set, () disables.
      seed: the sampler's base seed. policy_version: version of `params`.
      prompt_buckets: padded prompt lengths to compile for (default powers of two, then max_len).
      load_dtype: parameter dtype when `load_weights` reads an HF directory (`hf_io.load_hf`).
    """
    if max_len < 2:
      raise ValueError(f"max_len={max_len} must be >= 2 (one prompt token and one generated)")
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                       f"{cfg.max_position_embeddings}; pass max_len <= "
                       f"{cfg.max_position_embeddings}")
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be >= 1")
    if eos_token_ids is None:
      eos_token_ids = () if cfg.eos_token_id is None else (cfg.eos_token_id,)
    buckets = sorted(set(int(x) for x in (prompt_buckets or default_buckets(max_len))))
    if buckets[0] < 1 or buckets[-1] > max_len:
      raise ValueError(f"prompt_buckets={buckets} must lie in [1, max_len={max_len}]")
    if buckets[-1] < max_len:
      buckets.append(max_len)
    self.cfg, self.max_len, self.batch_size = cfg, int(max_len), int(batch_size)
    self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
    self.seed, self.prompt_buckets, self.load_dtype = int(seed), tuple(buckets), load_dtype
    self._params, self.policy_version = params, int(policy_version)
    self._lock = threading.Lock()
    self._calls = 0

  @classmethod
  def from_hf(cls, hf_dir: str, max_len: int, dtype=jnp.float32, policy_version: int = 0,
              **kwargs) -> "JaxSampler":
    """Loads a directory written by `hf_io.save_hf` (or an HF checkpoint); kwargs as __init__."""
    cfg, params = hf_io.load_hf(hf_dir, dtype=dtype)
    return cls(cfg, params, max_len, policy_version=policy_version, load_dtype=dtype, **kwargs)

  @property
  def call_count(self) -> int:
    """`generate` calls so far; call k draws its noise from fold_in(seed, sampling.seed, k)."""
    with self._lock:
      return self._calls

  @call_count.setter
  def call_count(self, value: int) -> None:
    """A resumed run's worker continues the noise stream where the interrupted one stopped."""
    with self._lock:
      self._calls = int(value)

  # ---- weights ----------------------------------------------------------------------------------

  def load_weights(self, weights: Weights) -> None:
    """Later `generate` calls use `weights` and tag `weights.version`.

    In-process handles carry the parameter pytree (used as is: the caller gives the sampler its
    own copy); a handle with only `hf_dir` (written by `hf_io.save_hf`) is loaded from disk.
    """
    cfg, params = weights.cfg, weights.params
    if params is None:
      if weights.hf_dir is None:
        raise ValueError(f"weights of version {weights.version} carry neither params nor hf_dir")
      cfg, params = hf_io.load_hf(weights.hf_dir, dtype=self.load_dtype)
    if cfg is not None and (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) != (
        self.cfg.vocab_size, self.cfg.num_hidden_layers, self.cfg.hidden_size):
      raise ValueError(f"weights of version {weights.version}: architecture (vocab "
                       f"{cfg.vocab_size}, layers {cfg.num_hidden_layers}, hidden "
                       f"{cfg.hidden_size}) differs from this sampler's ({self.cfg.vocab_size}, "
                       f"{self.cfg.num_hidden_layers}, {self.cfg.hidden_size}); build a new "
                       "JaxSampler for another model")
    with self._lock:
      if cfg is not None:
        self.cfg = cfg
      self._params, self.policy_version = params, int(weights.version)

  def close(self) -> None:
    with self._lock:
      self._params = None

  # ---- sampling ---------------------------------------------------------------------------------

  def _check_prompts(self, prompts, sampling: SamplingParams) -> list[np.ndarray]:
    return check_prompts(prompts, self.cfg.vocab_size, self.max_len, sampling.max_tokens)

  def generate(self, prompts: Sequence[np.ndarray], n: int,
               sampling: SamplingParams) -> list[Group]:
    """Samples `n` completions for each prompt (int32 [Lp]); one Group per prompt, in order.

    Completion tokens run up to and including the first stop / eos token ("stop") or stop after
    `sampling.max_tokens` tokens ("length"); logprobs are the processed log-probs (module doc).
    """
    if n < 1:
      raise ValueError(f"n={n} must be >= 1")
    prompts = self._check_prompts(prompts, sampling)
    with self._lock:
      params, version, cfg = self._params, self.policy_version, self.cfg
      call = self._calls
      self._calls += 1
    if params is None:
      raise ValueError("this JaxSampler is closed; build a new one")
    if not prompts:
      return []
    return self._sample_requests(cfg, params, version, [(prompts, n, call)], sampling)[0]

  def generate_requests(self, requests: Sequence[tuple[Sequence[np.ndarray], int, int]],
                        sampling: SamplingParams) -> list[list[Group]]:
    """Samples several requests in one call: their rows share the jitted batches.

    Args:
      requests: per request (prompts int32 [Lp] each, n samples per prompt, call index c).
      sampling: the settings of every request.
    Returns:
      per request, its Groups (one per prompt, in order) at the version held now.

    Request j's row r draws its noise from fold_in(seed, sampling.seed, c_j, r), exactly as row r
    of the `generate` call with index c_j: each request gets the completions it would get alone
    (the same tokens when the batches have the same shape; else up to their float rounding),
    whatever requests share the call. `call_count` is left as it is.
    """
    checked = []
    for prompts, n, call in requests:
      if n < 1:
        raise ValueError(f"n={n} must be >= 1")
      if call < 0:
        raise ValueError(f"call index {call} must be >= 0")
      checked.append((self._check_prompts(prompts, sampling), int(n), int(call)))
    with self._lock:
      params, version, cfg = self._params, self.policy_version, self.cfg
    if params is None:
      raise ValueError("this JaxSampler is closed; build a new one")
    return self._sample_requests(cfg, params, version, checked, sampling)

  def _stop_ids(self, sampling: SamplingParams) -> np.ndarray:
    """int32 [S]: the model's eos ids and the request's stop ids, padded with -1 (matches nothing)
    to a multiple of 8 so that a few lengths compile."""
    stop = sorted(set(self.eos_token_ids) | set(int(t) for t in sampling.stop_token_ids))
    stop_ids = np.full(max(8, -(-len(stop) // 8) * 8), -1, np.int32)
    stop_ids[:len(stop)] = stop
    return stop_ids

  def _sample_requests(self, cfg, params, version: int,
                       requests: Sequence[tuple[list[np.ndarray], int, int]],
                       sampling: SamplingParams) -> list[list[Group]]:
    """The rows of all `requests` ((prompts, n, call index) each; row r of a request is prompt
    r // n, sample r % n), sorted by prompt length and cut into batches of exactly `batch_size`
    rows (the last one padded); per request, its Groups."""
    stop_ids = self._stop_ids(sampling)
    sampling_key = jax.random.fold_in(jax.random.key(self.seed), sampling.seed)
    use_top_k = 0 < sampling.top_k < cfg.vocab_size
    use_top_p = sampling.top_p < 1.0
    scalars = (jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
               jnp.float32(sampling.top_p), jnp.asarray(stop_ids), jnp.int32(sampling.max_tokens))
    max_new = output_bucket(sampling.max_tokens)

    row_prompts = [p for prompts, n, _ in requests for p in prompts for _ in range(n)]
    row_call = np.concatenate([np.full(len(prompts) * n, call, np.int64)
                               for prompts, n, call in requests] or [np.zeros(0, np.int64)])
    row_local = np.concatenate([np.arange(len(prompts) * n) for prompts, n, _ in requests]
                               or [np.zeros(0, np.int64)])
    rows = len(row_prompts)
    lengths = np.asarray([p.size for p in row_prompts], np.int64)
    order = np.argsort(lengths, kind="stable")
    completions: list[Optional[Completion]] = [None] * rows
    bs = self.batch_size
    for start in range(0, rows, bs):
      idx = order[start:start + bs]
      real = len(idx)
      idx = np.concatenate([idx, np.full(bs - real, idx[0])])  # pad the batch with copies
      bucket = next(b for b in self.prompt_buckets if b >= lengths[idx].max())
      batch = np.zeros((bs, bucket), np.int32)
      for j, r in enumerate(idx):
        p = row_prompts[r]
        batch[j, :p.size] = p
      keys = _row_keys(sampling_key, row_call[idx], row_local[idx])
      valid = np.arange(bs) < real
      out = generate_batch(
          cfg, params, jnp.asarray(batch), jnp.asarray(lengths[idx], jnp.int32),
          jnp.asarray(valid), keys, *scalars,
          cache_len=min(self.max_len, bucket + max_new), max_new=max_new,
          use_top_k=use_top_k, use_top_p=use_top_p)
      out_t, out_lp, num, stopped = jax.device_get(out)
      for j in range(real):
        m = int(num[j])
        completions[idx[j]] = Completion(tokens=out_t[j, :m].copy(),
                                         logprobs=out_lp[j, :m].copy(),
                                         finish_reason="stop" if stopped[j] else "length")
    out_groups, first = [], 0
    for prompts, n, _ in requests:
      out_groups.append([Group(prompt_tokens=prompts[i],
                               completions=completions[first + i * n:first + (i + 1) * n],
                               policy_version=version, prompt_index=i)
                         for i in range(len(prompts))])
      first += len(prompts) * n
    return out_groups


  # ---- multi-turn ---------------------------------------------------------------------------------

  def generate_turns(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams,
                     driver: TurnDriver) -> None:
    """Multi-turn generation (`rollout.base.run_turns`) with the KV cache carried across turns.

    The call's rows (prompt r // n, sample r % n) are sorted by prompt length and cut into batches
    of `batch_size` rows, as in `generate`. Per batch: the prompts are prefilled, then each turn
    is decoded from the cache (`decode_turn`), `driver.record` returns the rows that continue with
    their observations, and [the turn's last token, observation] is prefilled into their cache
    rows (`decode.extend`) before the next turn: nothing is recomputed. The cache holds
    `driver.max_total` <= max_len tokens. Row r draws its noise from fold_in(seed,
    sampling.seed, call index, r), then the turn and the step (`decode_turn`); one call index per
    `generate_turns` call.
    """
    if n < 1:
      raise ValueError(f"n={n} must be >= 1")
    if driver.max_total > self.max_len:
      raise ValueError(f"a trajectory budget of {driver.max_total} tokens exceeds this sampler's "
                       f"max_len={self.max_len}")
    prompts = check_prompts(prompts, self.cfg.vocab_size, driver.max_total, 1,
                            max_len_name="trajectory budget")
    with self._lock:
      params, cfg, call = self._params, self.cfg, self._calls
      self._calls += 1
    if params is None:
      raise ValueError("this JaxSampler is closed; build a new one")
    stop_ids = self._stop_ids(sampling)
    sampling_key = jax.random.fold_in(jax.random.key(self.seed), sampling.seed)
    settings = dict(
        temperature=jnp.float32(sampling.temperature), top_k=jnp.int32(sampling.top_k),
        top_p=jnp.float32(sampling.top_p), stop_ids=jnp.asarray(stop_ids),
        max_new=output_bucket(sampling.max_tokens),
        use_top_k=0 < sampling.top_k < cfg.vocab_size, use_top_p=sampling.top_p < 1.0)
    lengths = np.repeat(np.asarray([p.size for p in prompts], np.int64), n)
    order = np.argsort(lengths, kind="stable")
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      self._turns_of_batch(cfg, params, prompts, n, idx,
                           _row_keys(sampling_key, np.full(len(idx), call), idx), driver, settings)

  def _turns_of_batch(self, cfg, params, prompts, n: int, idx: np.ndarray, keys, driver,
                      settings) -> None:
    """Every turn of the rows `idx` (one batch, padded to `batch_size` with inactive rows)."""
    bs, real = self.batch_size, len(idx)
    rows = np.concatenate([idx, np.full(bs - real, idx[0])])
    keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (bs - real,))]) if bs > real else keys
    lengths = np.asarray([prompts[r // n].size for r in rows], np.int32)
    bucket = next(b for b in self.prompt_buckets if b >= lengths.max())
    tokens = np.zeros((bs, bucket), np.int32)
    for j, r in enumerate(rows):
      tokens[j, :lengths[j]] = prompts[r // n]
    cache = decode.init_cache(cfg, bs, driver.max_total)
    logits, cache = _prefill(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    active = np.arange(bs) < real
    max_new = settings["max_new"]
    turn = 0
    while True:
      limits = np.asarray([driver.limit(int(r)) if a else 0 for r, a in zip(rows, active)],
                          np.int32)
      out_t, out_lp, num, stopped, cache = decode_turn(
          cfg, params, cache, logits, jnp.asarray(active), keys, jnp.int32(turn),
          settings["temperature"], settings["top_k"], settings["top_p"], settings["stop_ids"],
          jnp.asarray(np.minimum(limits, max_new)), max_new=max_new,
          use_top_k=settings["use_top_k"], use_top_p=settings["use_top_p"])
      out_t, out_lp, num, stopped = jax.device_get((out_t, out_lp, num, stopped))
      live = np.flatnonzero(active)
      turns = [Completion(tokens=out_t[j, :num[j]].copy(), logprobs=out_lp[j, :num[j]].copy(),
                          finish_reason="stop" if stopped[j] else "length") for j in live]
      going = dict(driver.record(turn, [int(rows[j]) for j in live], turns,
                                 [int(limits[j]) for j in live]))
      active = np.asarray([a and int(r) in going for r, a in zip(rows, active)])
      if not active.any():
        return
      turn += 1
      # [the turn's last token (not in the cache yet), the observation] of each continuing row
      appends = [np.concatenate([out_t[j, num[j] - 1:num[j]], going[int(rows[j])]])
                 if active[j] else np.zeros(0, np.int32) for j in range(bs)]
      size = output_bucket(max(len(a) for a in appends))
      append = np.zeros((bs, size), np.int32)
      for j, a in enumerate(appends):
        append[j, :len(a)] = a
      logits, cache = _extend(cfg, params, jnp.asarray(append),
                              jnp.asarray([len(a) for a in appends], np.int32), cache)


def _row_keys(sampling_key: jax.Array, calls: np.ndarray, rows: np.ndarray) -> jax.Array:
  """Typed PRNG keys [B]: fold_in(fold_in(sampling_key, calls[b]), rows[b]), row b's noise."""
  rows = jnp.asarray(rows, jnp.uint32)
  if np.all(calls == calls[0]):  # one call (every `generate`): its key folded once
    call_key = jax.random.fold_in(sampling_key, int(calls[0]))
    return jax.vmap(jax.random.fold_in, (None, 0))(call_key, rows)
  return jax.vmap(lambda c, r: jax.random.fold_in(jax.random.fold_in(sampling_key, c), r))(
      jnp.asarray(calls, jnp.uint32), rows)
