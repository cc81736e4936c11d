"""The train state and the jitted, sharded train step: log-probs -> GRPO/AsymRE loss -> AdamW update.

`make_train_step` returns `step(state, batch) -> (state, metrics)`, jitted once per batch shape (one
compile per length bucket), with the state donated and explicit in/out shardings (params and
optimizer state per `sharding.PARAM_RULES`, batch rows over ("data", "fsdp"), metrics replicated).

Gradient accumulation (`num_microbatches=k`) splits the B rows into k micro-batches of B/k rows
(row r goes to micro-batch r % k, so each device keeps its own rows) and `lax.scan`s over them,
summing weighted gradients in float32. The weights make the result equal to the loss of the whole
batch (up to float32 summation order), for every aggregation of `jaxreplay.learner.losses.aggregate`:
  token_mean     loss = sum_k (n_k / N) loss_k   n_k, N: valid tokens in micro-batch k / the batch
  sequence_mean  loss = sum_k (r_k / R) loss_k   r_k, R: rows with >= 1 valid token
  constant       loss = sum_k loss_k             each loss_k divides by the whole batch's normaliser
Aux statistics combine by the kind `losses.AUX_KINDS` (or the correction's row of
`corrections.CORRECTIONS`) declares for each (sum, max, weighted by tokens, by rows, or like the
loss); a statistic without a declared kind is an error, with any k.

Packed batches (`Batch.packed`, `collate(..., pack=True)`): "rows" above are rollouts, i.e. (row,
segment) pairs, and the default "constant" normaliser is (rollouts in the batch) * T, which equals
the unpacked B * T whenever the unpacked batch has no all-padding row (as in every run's step) and
the packed T is the unpacked one (`collate(..., same_bucket=True)`, what the pipeline asks for
under "constant").

The KL option keeps frozen reference params in `TrainState.ref_params` (no optimizer state for them);
reference log-probs are computed inside the step, without gradients.

LoRA (`lora=adapters.FrozenBase`): `TrainState.params` are the adapters (`models.lora`), so the
optimizer state, the gradients, the clipping norm and checkpoints cover only them; the frozen base
is a separate, never donated argument of the jitted step (bound by the returned function), and the
forward runs `lora.attach(base, adapters)`. The KL reference is the base itself (the initial
policy: adapters start with b = 0), so no reference copy is kept.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.learner import corrections
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import losses
from jaxreplay.infra import sharding
from jaxreplay.learner.batch import Batch
from jaxreplay.models import lora as lora_lib
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig

NONFINITE_CHECKS = ("grads", "updated")
# trainer.sampling_logprobs: the trainer's log-probs of the rollouts' sampling distribution
# ("processed": rollout.temperature / top_k / top_p applied to its own logits,
# `logprobs.LogprobProcessing`), or of the raw softmax ("raw", the behaviour before issue 27).
SAMPLING_LOGPROBS = ("processed", "raw")
# How nonfinite_check "grads" skips an update, by the platform of the mesh's devices (`skip_mode`):
#   cond    `lax.cond`: the update runs only when it is kept (CPU: no select pass over the params
#           and the optimizer state, ~8% of a 40M-parameter step)
#   select  the update always runs and `where(finite, new, old)` keeps the old values, fused into
#           the update's elementwise kernels. XLA:GPU's conditional instead copies the whole
#           state into the conditional's own output buffers: +9.7 GiB of temporaries per device
#           for Qwen3-8B at T=3 (params, mu, nu: `run.gpu_compile` measures it)
SKIP_MODES = ("auto", "cond", "select")
SKIP_BY_PLATFORM = {"cpu": "cond"}  # any other platform: "select"


@flax.struct.dataclass
class TrainState:
  """step int32 [] (updates applied so far), params, opt_state, rng uint32 [2], ref_params or None."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None


# ---- train state ------------------------------------------------------------------------------

def _raw_key(rng: jax.Array) -> jax.Array:
  """A uint32 [2] key (typed keys are converted) so that checkpoints hold plain arrays."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return jnp.asarray(rng, jnp.uint32)


def state_shardings(state: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, P]] = sharding.PARAM_RULES) -> Any:
  """NamedShardings of a TrainState (of arrays or ShapeDtypeStructs): rules by path, rest replicated."""
  return sharding.tree_shardings(state, mesh, rules)


def init_train_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, rng: jax.Array,
                     params: Any = None, mesh: Optional[Mesh] = None,
                     rules: Sequence[tuple[str, P]] = sharding.PARAM_RULES,
                     with_ref_params: bool = False, donate_params: bool = False) -> TrainState:
  """A TrainState at step 0, created directly in its sharded layout (no full copy on one device).

  params: None to initialise randomly from `rng` (`transformer.init_params`), or a pytree (e.g. from
    `hf_io.load_hf`) that is copied onto the mesh (the caller's arrays are left untouched), or,
    with donate_params=True, consumed: device arrays already in the target layout become the
    state's params without a second copy on device (the caller must not use them afterwards).
  with_ref_params: also keep a frozen copy of the initial params as the KL reference.
  mesh: default all devices as (1, -1, 1). A leaf whose dimension the mesh axes of its rule do not
    divide is stored zero-padded to `sharding.storage_shape` (never replicated); the model
    functions slice it back (`models.layout.unpad`).
  The shardings of the result are `jax.tree.map(lambda x: x.sharding, state)`, which equals
  `state_shardings(state, mesh, rules)`.
  """
  mesh = sharding.make_mesh() if mesh is None else mesh
  init_rng, state_rng = jax.random.split(_raw_key(rng))

  def build(p, init_rng, state_rng):
    if p is None:
      p = transformer.init_params(model_cfg, init_rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
                      rng=state_rng, ref_params=jax.tree.map(jnp.copy, p) if with_ref_params else None)

  logical = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.PRNGKey(0)))
  storage = sharding.storage_shapes(logical, mesh, rules)  # padded where the mesh does not divide
  if params is not None:
    want = jax.tree.map(lambda s: tuple(s.shape), logical)
    got = jax.tree.map(lambda x: tuple(jnp.shape(x)), params)
    is_shape = lambda x: isinstance(x, tuple)
    if jax.tree.structure(got, is_leaf=is_shape) != jax.tree.structure(want, is_leaf=is_shape):
      raise ValueError(f"params do not match model_cfg: expected shapes {want}, got {got}")
    ok = jax.tree.map(lambda g, w, s: g in (w, tuple(s.shape)), got, want, storage, is_leaf=is_shape)
    if not all(jax.tree.leaves(ok)):
      raise ValueError(f"params do not match model_cfg: expected shapes {want}, got {got}")

  def build_padded(p, init_rng, state_rng):
    if p is None:
      p = transformer.init_params(model_cfg, init_rng)
    return build(jax.tree.map(lambda x, s: sharding.pad_to(x, s.shape), p, storage),
                 init_rng, state_rng)

  abstract = jax.eval_shape(build_padded, params, init_rng, state_rng)
  shardings = state_shardings(abstract, mesh, rules)
  if params is None:
    return jax.jit(build_padded, out_shardings=shardings)(None, init_rng, state_rng)
  # A private sharded copy (unless donate_params), donated to the jit so that the state's params
  # reuse its buffers instead of holding one more copy on device. Params already in their padded
  # storage shapes (e.g. `hf_io.load_hf(..., shardings=...)`) are placed as they are.
  padded_in = jax.tree.map(lambda x, s: tuple(jnp.shape(x)) == tuple(s.shape), params, storage)
  if all(jax.tree.leaves(padded_in)):
    in_sh, donate = shardings.params, (0,)
  else:  # padded in the jit: the logical-shape copy cannot be reused for the output
    in_sh, donate = sharding.tree_shardings(params, mesh, rules, indivisible="replicate"), ()
  if not donate_params:
    # jax.device_put(..., may_alias=False) onto a replicated multi-device sharding still aliases
    # the source device's buffer (jax 0.10), which the donation below would delete: copy first.
    params = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, params)
  params = jax.device_put(params, in_sh)
  return jax.jit(build_padded, out_shardings=shardings, donate_argnums=donate)(params, init_rng,
                                                                               state_rng)


# ---- the train step ---------------------------------------------------------------------------

def _split_microbatches(batch: Batch, k: int, mesh: Mesh) -> Batch:
  """[B, ...] -> [k, B/k, ...]; micro-batch i holds rows i, i + k, ...; rows stay on their device."""
  def split(x):
    x = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, mesh, P(None, sharding.batch_axes(mesh)))
  return jax.tree.map(split, batch)


def _counts(batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(valid tokens, sequences with >= 1 valid token) of a batch's completion mask, float32; a
  sequence is a row, or in a packed batch a (row, segment) pair."""
  m = (batch.completion_mask > 0).astype(jnp.float32)
  if batch.packed:
    return jnp.sum(m), losses.num_sequences(m, batch.segment_ids)
  return jnp.sum(m), jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32))


def _global_norm(tree: Any) -> jax.Array:
  """sqrt of the sum of squares of all leaves, accumulated in float32 (params may be bfloat16)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _aux_kind(key: str) -> str:
  """The kind of statistic `key`: `losses.AUX_KINDS` (a loss's) or its correction's row of
  `corrections.CORRECTIONS`; else an error that names the key and where to declare it."""
  kind = losses.AUX_KINDS.get(key) or corrections.aux_kinds().get(key)
  if kind not in losses.AUX_KIND_NAMES:
    raise ValueError(
        f"loss statistic {key!r} has no valid kind in jaxreplay.learner.losses.AUX_KINDS (got "
        f"{kind!r}) nor in its correction's row of corrections.CORRECTIONS: declare there how it "
        f"combines over micro-batches, one of {losses.AUX_KIND_NAMES}")
  return kind


def _combine_aux(aux: dict, tok_w: jax.Array, row_w: jax.Array, loss_w: jax.Array) -> dict:
  """Per-micro-batch aux [k] -> batch aux, each statistic by its kind (`_aux_kind`).

  tok_w, row_w, loss_w: float32 [k], the micro-batches' shares of valid tokens, of rows with valid
  tokens, and of the loss.
  """
  combine = {
      "sum": jnp.sum,
      "max": jnp.max,
      "token_mean": lambda v: jnp.sum(tok_w * v),
      "row_mean": lambda v: jnp.sum(row_w * v),
      "loss": lambda v: jnp.sum(loss_w * v),
  }
  return {key: combine[_aux_kind(key)](v) for key, v in aux.items()}


def logprob_processing(config: Any) -> Optional[logprobs_lib.LogprobProcessing]:
  """The `LogprobProcessing` of a run (`make_train_step` / `make_logprob_fn`'s
  logprob_processing): trainer.sampling_logprobs="processed" and a rollout temperature / top-k /
  top-p that is not the raw softmax; else None (the raw log-probs, the same computation bit for
  bit). See `logprobs.LogprobProcessing` for why the ratio needs it."""
  if config.trainer.get("sampling_logprobs", "processed") == "raw":
    return None
  r = config.rollout
  processing = logprobs_lib.LogprobProcessing(temperature=float(r.temperature),
                                              top_k=int(r.top_k), top_p=float(r.top_p))
  return None if processing.is_identity else processing


def step_options(trainer_config: Any) -> dict:
  """`make_train_step`'s keyword options from the config's `trainer` section (config/defaults.py):
  compute_entropy (`trainer.log_entropy`), logprob_remat (`trainer.logprob_remat`) and
  nonfinite_check (`trainer.nonfinite_check`)."""
  return {"compute_entropy": bool(trainer_config.get("log_entropy", True)),
          "logprob_remat": str(trainer_config.get("logprob_remat", "auto")),
          "nonfinite_check": str(trainer_config.get("nonfinite_check", "grads"))}


def _accumulated_grads(grad_fn: Callable, state: TrainState, microbatches: Batch, param_shardings,
                       aggregation: str, n_tok, n_rows):
  """Gradient accumulation over k micro-batches (a `lax.scan`, float32 accumulators sharded as the
  params): each micro-batch's loss is weighted so the sum equals the whole batch's aggregation
  (tokens / rows / 1 for token_mean / sequence_mean / constant). Returns (loss, aux, entropy sum,
  grads in the params' dtypes)."""
  zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(
      jnp.zeros(p.shape, jnp.float32), s), state.params, param_shardings)

  def body(acc, mb):
    tok, rows = _counts(mb)
    tok_w = tok / jnp.maximum(n_tok, 1.0)
    row_w = rows / jnp.maximum(n_rows, 1.0)
    loss_w = {"token_mean": tok_w, "sequence_mean": row_w, "constant": 1.0}[aggregation]
    loss_w = jnp.asarray(loss_w, jnp.float32)
    loss, aux, ent_sum, g = grad_fn(state.params, state.ref_params, mb, loss_w)
    acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
    return acc, (loss, aux, ent_sum, tok_w, row_w, loss_w)

  grads, (loss_k, aux_k, ent_k, tok_w, row_w, loss_w) = jax.lax.scan(body, zeros, microbatches)
  loss = jnp.sum(loss_w * loss_k)
  aux = _combine_aux(aux_k, tok_w, row_w, loss_w)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  return loss, aux, jnp.sum(ent_k), grads


def resolve_skip_mode(skip_mode: str, mesh: Mesh) -> str:
  """`skip_mode` ("auto" | "cond" | "select", see `SKIP_MODES`) for the devices of `mesh`."""
  if skip_mode not in SKIP_MODES:
    raise ValueError(f"skip_mode={skip_mode!r}: expected one of {SKIP_MODES}")
  if skip_mode != "auto":
    return skip_mode
  return SKIP_BY_PLATFORM.get(mesh.devices.flat[0].platform, "select")


def _apply_update(optimizer: optax.GradientTransformation, state: TrainState, grads, loss,
                  grad_norm, skip_nonfinite: bool, nonfinite_check: str, skip_mode: str = "cond",
                  veto=None):
  """The optimizer update, skipped on a non-finite loss / gradient norm (`make_train_step`'s
  skip_nonfinite and nonfinite_check; skip_mode "cond" or "select", see `SKIP_MODES`) and, given
  `veto` (bool[]: the gradient gate fired), when vetoed. Returns (params, opt_state, param_norm,
  finite: bool[] or None when nothing is checked)."""
  def update(params_opt):
    params, opt_state = params_opt
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  finite = None
  if (skip_nonfinite and nonfinite_check == "grads") or (veto is not None and not skip_nonfinite):
    keep = True
    if skip_nonfinite:
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      keep = finite
    if veto is not None:
      keep = keep & ~veto
    if skip_mode == "select":
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old),
                                       update((state.params, state.opt_state)),
                                       (state.params, state.opt_state))
    else:
      # Decided before the update, which then runs only when it is kept: no select over the
      # params and optimizer state (a pass over both, ~8% of a 40M-parameter CPU step).
      params, opt_state = jax.lax.cond(keep, update, lambda x: x,
                                       (state.params, state.opt_state))
    param_norm = _global_norm(params)
  else:
    params, opt_state = update((state.params, state.opt_state))
    param_norm = _global_norm(params)
    if skip_nonfinite:  # "updated": also the updated parameters' norm
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(param_norm)
      keep = finite if veto is None else finite & ~veto
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old),
                                       (params, opt_state), (state.params, state.opt_state))
      if veto is not None:
        param_norm = _global_norm(params)
  return params, opt_state, param_norm, finite


def gate_leaf(model_cfg: ModelConfig) -> str:
  """The parameter the gradient gate monitors (`make_train_step`'s gate_leaf): the LM head
  "lm_head" [D, V], or with tied embeddings (`tie_word_embeddings`: no lm_head leaf) the one
  matrix "embed_tokens" [V, D] that serves as the LM head, whose gradient is then the head's part
  plus the input embedding rows' part."""
  return "embed_tokens" if model_cfg.tie_word_embeddings else "lm_head"


def make_train_step(model_cfg: ModelConfig, optimizer: optax.GradientTransformation,
                    loss_fn: loss_fn_lib.LossFn, mesh: Mesh, state_shardings: Any, num_microbatches: int = 1,
                    chunk_size: int = 512, learning_rate_fn: Optional[Callable] = None,
                    compute_entropy: bool = True, donate: bool = True,
                    skip_nonfinite: bool = True, logprob_remat: str = "auto",
                    nonfinite_check: str = "grads",
                    logprob_processing: Optional[logprobs_lib.LogprobProcessing] = None,
                    lora=None, skip_mode: str = "auto", gate_leaf: Optional[str] = None):
  """Builds the jitted `step(state: TrainState, batch: Batch) -> (state, metrics)`.

  loss_fn: a `loss_fn.LossFn` from `loss_fn.make_loss_fn(...)`; its aggregation / normalizer set the micro-batch
    weights, its needs_ref whether the step computes reference log-probs.
  num_microbatches: k; B must be a multiple of k * data * fsdp.
  chunk_size: sequence chunk of the LM head in `token_logprobs`.
  learning_rate_fn: the optimizer's schedule (`optim.make_schedule(...)`), for the learning_rate metric.
  compute_entropy: report the mean next-token entropy over completion tokens (costs one extra pass
    over each logits chunk).
  logprob_remat: `token_logprobs`'s remat of the LM-head chunks ("auto" | "always" | "never").
  skip_nonfinite: when the loss or the gradient norm is NaN/inf (and with nonfinite_check="updated"
    also the updated parameters' norm), keep the old params and optimizer state (the step counter
    and rng still advance) and report `nonfinite_skipped` = 1; the caller decides when too many
    skips stop the run (`safety.NonFiniteGuard`).
  nonfinite_check: "grads" (default): the skip is decided from the loss and the gradient norm
    before the update (`lax.cond`: a skipped update is not computed). Finite gradients give a finite
    AdamW update of finite params (clipped or not: Adam's step is bounded, and squares that
    overflow make the gradient norm inf), and non-finite params make the loss non-finite, so no
    NaN is written into the state. "updated": also checks the updated parameters' norm, selecting
    old or new params and optimizer state after the update (one more pass over both; the
    behaviour before issue 13).
  skip_mode: how "grads" skips (`SKIP_MODES`): "auto" is "cond" on CPU devices, "select" on GPUs;
    the values are the same either way.
  logprob_processing: None (log-probs of the raw softmax), or the rollouts' sampling distribution
    (`logprob_processing(config)`): the policy, reference and entropy are those of the processed
    distribution, whose log-probs the samplers store (`logprobs.LogprobProcessing`).
  lora: an `adapters.FrozenBase` (LoRA: state.params are its adapters, see the module docstring),
    or None (full fine-tuning).
  gate_leaf: the gradient gate (`data.batch_reuse`, Dynamic Gradient Gating): the params' top-level
    leaf it monitors (`gate_leaf(model_cfg)`); the step is then `step(state, batch, bound)` with
    `bound` a float32 scalar: when the leaf's gradient energy (its squared L2 norm, before
    clipping) exceeds it, the update is intercepted before the optimizer (params and optimizer
    state kept, the step counter advances, as for a non-finite skip). Metrics gain
    gate/lm_head_grad_energy and gate/fired (1 when intercepted). Not with LoRA (the head is
    frozen there).
  metrics (float32 scalars, replicated): loss, grad_norm (before clipping), param_norm, learning_rate,
    entropy, tokens (completion tokens), seq_tokens (non-padding tokens), and loss_fn's aux (each
    of its keys needs a kind: `losses.AUX_KINDS`, or its correction's row). A batch's staleness is the buffer's to report
    (`ReplayBuffer.sample(..., current_version=)`), once.
  """
  if not isinstance(loss_fn, loss_fn_lib.LossFn):
    raise TypeError(f"loss_fn must be a loss_fn.LossFn, built by loss_fn.make_loss_fn(name, ...); "
                    f"got {type(loss_fn).__name__}")
  if nonfinite_check not in NONFINITE_CHECKS:
    raise ValueError(f"nonfinite_check={nonfinite_check!r}: expected one of {NONFINITE_CHECKS}")
  skip_mode = resolve_skip_mode(skip_mode, mesh)
  k = int(num_microbatches)
  if k < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
  if gate_leaf is not None and lora is not None:
    raise ValueError("the gradient gate monitors the LM head's gradient, which LoRA freezes: "
                     "use buffer.reuse_control='gradient_gate' with full fine-tuning")
  aggregation = loss_fn.aggregation
  needs_ref = loss_fn.needs_ref
  multiple = sharding.batch_size_multiple(mesh)

  def forward(params, ref_params, mb: Batch, lfn, base=None):
    """Loss of one (micro-)batch and its statistics (`base`: LoRA's frozen base, else None)."""
    out = logprobs_lib.token_logprobs(model_cfg, _model_params(lora, params, base), mb.tokens,
                                      mb.targets, mb.positions, mb.segment_ids,
                                      chunk_size=chunk_size, return_entropy=compute_entropy,
                                      remat=logprob_remat, processing=logprob_processing,
                                      single_sequence_rows=not mb.packed)
    lp, ent = out if compute_entropy else (out, None)
    ref_lp = None
    if lora is not None and needs_ref:  # the initial policy is the base itself
      ref_params = base
    if ref_params is not None:
      ref_lp = jax.lax.stop_gradient(logprobs_lib.token_logprobs(
          model_cfg, jax.lax.stop_gradient(ref_params), mb.tokens, mb.targets, mb.positions,
          mb.segment_ids, chunk_size=chunk_size, processing=logprob_processing,
          single_sequence_rows=not mb.packed))
    loss, aux = lfn(lp, mb, ref_lp) if ref_params is not None else lfn(lp, mb)
    m = (mb.completion_mask > 0).astype(jnp.float32)
    ent_sum = jnp.sum(jax.lax.stop_gradient(ent) * m) if ent is not None else jnp.zeros(())
    return loss, (aux, ent_sum)

  def weighted_grad(params, ref_params, mb: Batch, weight, lfn, base=None):
    def f(p):
      loss, extra = forward(p, ref_params, mb, lfn, base)
      return weight * loss, (loss, extra)
    (_, (loss, (aux, ent_sum))), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, aux, ent_sum, grads

  def step(state: TrainState, batch: Batch, base=None, bound=None):
    b, t = batch.tokens.shape
    if b % (k * multiple):
      raise ValueError(f"batch of {b} rows: must be a multiple of num_microbatches * data * fsdp = "
                       f"{k} * {multiple} = {k * multiple}")
    if needs_ref and state.ref_params is None and lora is None:
      raise ValueError("loss_fn has kl_coef != 0 but the state has no ref_params; create it with "
                       "init_train_state(..., with_ref_params=True)")
    lfn = loss_fn
    n_tok, n_rows = _counts(batch)
    if aggregation == "constant" and loss_fn.normalizer is None:
      # The whole batch's B * T; packed: (rollouts) * T, what the same rollouts unpacked give.
      lfn = dataclasses.replace(
          loss_fn, normalizer=jnp.maximum(n_rows, 1.0) * t if batch.packed else float(b * t))
    grad_fn = functools.partial(weighted_grad, lfn=lfn, base=base)
    if k == 1:
      loss, aux, ent_sum, grads = grad_fn(state.params, state.ref_params, batch, 1.0)
      for key in aux:
        _aux_kind(key)  # an undeclared statistic fails with k = 1 too, not once k > 1 is set
    else:
      loss, aux, ent_sum, grads = _accumulated_grads(
          grad_fn, state, _split_microbatches(batch, k, mesh), state_shardings.params, aggregation,
          n_tok, n_rows)
    grad_norm = _global_norm(grads)
    fired = energy = None
    if bound is not None:  # the gradient gate: decided on the unclipped gradient, before Adam
      energy = jnp.sum(jnp.square(grads[gate_leaf].astype(jnp.float32)))
      fired = energy > bound
      if skip_nonfinite:
        fired = fired & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state, param_norm, finite = _apply_update(
        optimizer, state, grads, loss, grad_norm, skip_nonfinite, nonfinite_check, skip_mode,
        veto=fired)
    rng, _ = jax.random.split(state.rng)

    metrics = {
        "loss": loss, "grad_norm": grad_norm, "param_norm": param_norm,
        "tokens": n_tok, "seq_tokens": jnp.sum((batch.segment_ids > 0).astype(jnp.float32)),
    }
    if compute_entropy:
      metrics["entropy"] = ent_sum / jnp.maximum(n_tok, 1.0)
    if learning_rate_fn is not None:
      metrics["learning_rate"] = learning_rate_fn(state.step)
    metrics.update(aux)
    if skip_nonfinite:
      metrics["nonfinite_skipped"] = 1.0 - finite.astype(jnp.float32)
    if bound is not None:
      metrics["gate/lm_head_grad_energy"] = energy
      metrics["gate/fired"] = fired.astype(jnp.float32)
    metrics = {key: jnp.asarray(v, jnp.float32) for key, v in metrics.items()}
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng,
                           ref_params=state.ref_params)
    return new_state, metrics

  batch_sh = NamedSharding(mesh, P(sharding.batch_axes(mesh)))  # a prefix: rows of every field
  out_shardings = (state_shardings, sharding.replicated(mesh))
  if gate_leaf is not None:
    def gated_step(state: TrainState, batch: Batch, bound):
      return step(state, batch, None, jnp.asarray(bound, jnp.float32))
    jitted = jax.jit(sharding.under_mesh(gated_step, mesh),
                     in_shardings=(state_shardings, batch_sh, sharding.replicated(mesh)),
                     out_shardings=out_shardings, donate_argnums=(0,) if donate else ())
    return _with_global_batch(jitted, mesh)
  in_shardings = (state_shardings, batch_sh) + (() if lora is None else (lora.shardings,))
  jitted = jax.jit(sharding.under_mesh(step, mesh), in_shardings=in_shardings,
                   out_shardings=out_shardings,
                   donate_argnums=(0,) if donate else ())
  return _with_global_batch(_bind_base(jitted, lora), mesh)


def all_finite(tree: Any) -> bool:
  """Whether every floating-point leaf of `tree` (arrays, possibly sharded) is finite (one host
  round trip; checked before a checkpoint or an HF export is written)."""
  leaves = [x for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return True
  return bool(jax.device_get(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))))


def _with_global_batch(jitted: Callable, mesh: Mesh) -> Callable:
  """Multi-process runs: host batches become global arrays before the jitted call."""
  if jax.process_count() == 1:
    return jitted

  def call(params_or_state, batch, *args):
    return jitted(params_or_state, sharding.global_batch(batch, mesh), *args)
  call.lower = jitted.lower
  return call


def _model_params(lora, params: Any, base: Any) -> Any:
  """The forward's params: `params` itself, or with LoRA the base with `params` (adapters)
  attached (`lora.attach`)."""
  return params if lora is None else lora_lib.attach(base, params, lora.spec)


def _bind_base(jitted: Callable, lora) -> Callable:
  """`fn(x, batch)` calling `jitted(x, batch, lora.params)` (LoRA's frozen base, an argument so
  that it is neither a compile-time constant nor donated); `jitted` itself without LoRA."""
  if lora is None:
    return jitted

  def call(params_or_state, batch):
    return jitted(params_or_state, batch, lora.params)
  call.lower = lambda params_or_state, batch: jitted.lower(params_or_state, batch, lora.params)
  return call


def make_logprob_fn(model_cfg: ModelConfig, mesh: Mesh, param_shardings: Any, chunk_size: int = 512,
                    return_entropy: bool = False,
                    logprob_processing: Optional[logprobs_lib.LogprobProcessing] = None,
                    lora=None):
  """Jitted forward-only `fn(params, batch) -> logprobs float32 [B, T]` (, entropy [B, T]).

  Values are 0 where `batch.completion_mask` is 0, aligned with `Batch.behaviour_logprobs`, so the
  result compares directly with the sampler's log-probs (trainer/sampler mismatch) or serves as the
  reference policy's log-probs. Outputs are batch-sharded; params are not donated. With `lora` (an
  `adapters.FrozenBase`) `params` are its adapters.
  logprob_processing: as in `make_train_step` (the samplers' processed distribution, so that the
  mismatch probe compares like with like).
  """
  def fn(params, batch: Batch, base=None):
    out = logprobs_lib.token_logprobs(model_cfg, _model_params(lora, params, base), batch.tokens,
                                      batch.targets,
                                      batch.positions, batch.segment_ids, chunk_size=chunk_size,
                                      return_entropy=return_entropy,
                                      processing=logprob_processing,
                                      single_sequence_rows=not batch.packed)
    valid = batch.completion_mask > 0
    if return_entropy:
      return jnp.where(valid, out[0], 0.0), jnp.where(valid, out[1], 0.0)
    return jnp.where(valid, out, 0.0)

  batch_sh = NamedSharding(mesh, P(sharding.batch_axes(mesh)))
  in_shardings = (param_shardings, batch_sh) + (() if lora is None else (lora.shardings,))
  jitted = jax.jit(sharding.under_mesh(fn, mesh), in_shardings=in_shardings,
                   out_shardings=batch_sh)
  return _with_global_batch(_bind_base(jitted, lora), mesh)
