r"""Gradient noise against staleness: a dedicated, deterministic probe of Theorem 4.5's sigma(x).

The library part of `bench/probe_sigma.py` (its command line, table, plot and JSON); the
statistics are in `jaxreplay.science.noise_stats`.

Theorem 4.4 / 4.5 (PAPER.md, "Theory") assume a stochastic gradient computed on a rollout of
staleness x has noise E||eps||^2 <= sigma^2(x), sigma non-decreasing, and App. 9.3.2 takes
sigma(x) = (x/tau)^alpha with alpha < 1/2. This probe measures sigma^2(s) directly:

1. Training. Starting from the config's warm-start (`model.path`, else a random init) with the
   config's optimizer, loss and sampling settings, K on-policy steps (N = B = R: each step samples
   B rollouts at the current params, ceil(B / G) prompts x G completions, and takes one step of
   `trainer.make_train_step`). Host copies of theta_v are kept for every version v = K - s the
   probe needs.
2. Probe. At theta_T (T = K) and each staleness s of the grid (0, 1, 2, 4, 8, 16, 32; s <= K):
   M rollouts (M / G fixed probe prompts from their own `PromptSource` stream, G completions each,
   the task's rewards, the config's advantages) are sampled by a `JaxSampler` holding theta_{T-s},
   with the same sampler seed at every s (common random numbers: a prompt's completions at two
   staleness levels share their sampling noise). They are cut into n = M / B disjoint minibatches
   of B rollouts made of whole groups (so minibatches are independent given the params), and each
   minibatch's loss gradient g_b(s) is computed at theta_T: the training loss
   (`loss_fn.make_loss_fn` of the config), whose importance ratio is pi_{theta_T} over the
   rollouts' own behaviour log-probs (those of theta_{T-s}).
3. Estimates (every one from the Gram matrices of the flattened gradients, float64):
     var_B(s)    = 1/(n-1) sum_b ||g_b(s) - g_bar(s)||^2   unbiased variance of a B-rollout
                   minibatch gradient (squared L2 norm of d loss / d params);
     sigma^2(s)  = B * var_B(s)                             per rollout (the theory's sigma^2);
     bias(s)     = ||g_bar(s) - g_bar(0)||, debiased: with paired differences d_b = g_b(s) - g_b(0)
                   (same prompts and noise), ||d_bar||^2 - var(d_b)/n is unbiased for the squared
                   distance of the expected gradients (the theory's kappa ||theta_t - theta_{t_i}||
                   term); the raw ||d_bar|| is reported too.
   Intervals: 95% percentile bootstrap over minibatches; a replicate resamples minibatch indices
   once for every s (the minibatches at different s share prompts), so it also gives intervals
   for ratios sigma^2(s) / sigma^2(0) and for the fitted alpha.
4. Fit and design. sigma(s) = (s/tau)^alpha by `design.fit_power_law_noise` on s >= 1 (the
   power law is 0 at s = 0, while the on-policy noise sigma^2(0) is not, so s = 0 is left out of
   the fit; a fit of sigma against s + 1 on every point is reported beside it). Theorem 4.5's
   N/R = x*, B/R = y* at the config's `scheduler.mu` for rho in {0.1, 1}: the closed form
   `design.power_law_design(mu, rho, alpha)` when 0 < alpha < 1/2, and
   `design.optimal_design` on the measured curve (`measured_sigma2`: linear on [0, s_1],
   power-law pieces between positive grid points, the fitted power law beyond the grid), made
   non-decreasing by a running maximum ("max", the assumption's bound) or averaged over staleness
   in [0, x] ("mean": a replayed sample of a FIFO buffer of x steps has uniform staleness).

`run_probe` returns the result record (the JSON that `bench/probe_sigma.py` writes). It runs on
one device (the first of `jax.devices()`) whatever the config's mesh, so results do not depend on
the emulated device count; deterministic for a given config and settings. `ProbeSettings.quick()`
(K = 4, M = 128, B = 2G, s in {0, 1, 2, 4}) is the end-to-end test's setting.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxreplay.config import validation
from jaxreplay.run import build as build_lib
from jaxreplay.data import collate as collate_lib
from jaxreplay.data import experience
from jaxreplay.models import hf_io
from jaxreplay.models.config import ModelConfig
from jaxreplay.science import noise_stats
from jaxreplay.infra import sharding
from jaxreplay.learner import algorithms
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.rollout.base import SamplingParams, Weights
from jaxreplay.rollout.jax_sampler import JaxSampler

DEFAULT_STALENESS = (0, 1, 2, 4, 8, 16, 32)
PROBE_PROMPT_SEED_OFFSET = 7919     # the probe's prompts: PromptSource(task, seed + this)
PROBE_SAMPLER_SEED_OFFSET = 104729  # the probe's sampler seed (the same at every staleness)
TRAIN_SAMPLER_SEED_OFFSET = 1


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
  """The probe's sizes (counts of rollouts and steps)."""
  steps: int = 64                   # K on-policy training steps before the probe
  rollouts: int = 1024              # M rollouts per staleness (rounded down to whole minibatches)
  minibatch: int = -2               # B rollouts per minibatch (whole groups): -k = k groups,
                                    # 0 = buffer.batch_size
  staleness: tuple[int, ...] = DEFAULT_STALENESS
  bootstrap: int = 1000             # bootstrap replicates
  seed: int = 0                     # bootstrap seed

  @classmethod
  def quick(cls) -> "ProbeSettings":
    return cls(steps=4, rollouts=128, minibatch=-2, staleness=(0, 1, 2, 4), bootstrap=200)


# ---- minibatch layouts ---------------------------------------------------------------------------

LAYOUTS = ("groups", "spread")


def layout_order(num_prompts: int, group_size: int, layout: str) -> np.ndarray:
  """Order of the P * G probe rollouts (grouped: rollout p * G + j is member j of prompt p) before
  cutting it into consecutive minibatches.

    "groups": as sampled, so a minibatch of B (a multiple of G) rollouts holds B / G whole groups
      and minibatches are independent given the params (exactly unbiased variance, exact
      bootstrap);
    "spread": member-major (member 0 of every prompt, then member 1, ...), so a minibatch of
      B <= P rollouts holds B different prompts, like a batch drawn uniformly from a large buffer;
      it measures the marginal per-rollout variance (within-group covariance left out), with an
      O(1/n) bias and approximate intervals since a group spans several minibatches.

  Returns:
    int [P * G] indices into the grouped rollout list.
  """
  idx = np.arange(num_prompts * group_size).reshape(num_prompts, group_size)
  if layout == "groups":
    return idx.reshape(-1)
  if layout == "spread":
    return idx.T.reshape(-1)
  raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")


# ---- the run's parts ------------------------------------------------------------------------------

@dataclasses.dataclass
class Parts:
  """What the probe builds from a config (one device). The train state is not a part: `build_parts`
  returns it beside them, and its one owner, `train_on_policy`, hands the trained one back."""
  config: Any
  task: Any
  codec: Any
  model_cfg: ModelConfig
  param_shardings: Any  # the train state's params' (one device)
  train_step: Callable
  loss_fn: loss_fn_lib.LossFn
  sampling: SamplingParams
  advantage_fn: Callable
  buckets: tuple
  ref_params: Any


def build_parts(c, workdir: str) -> tuple[Parts, Any]:
  """(parts, the initial train state): task, codec, model (warm-start), one-device mesh, train
  step, from config `c`."""
  validation.validate_config(c)
  task = build_lib.make_task(c.task)
  codec, _ = build_lib.load_codec(c, task, workdir)
  model_cfg = build_lib.model_config(c, codec)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = None
  if c.model.path:
    _, params = hf_io.load_hf(c.model.path, dtype=model_cfg.params_dtype)
  t = c.trainer
  optimizer, lr_fn, loss_fn = build_lib.optimization(c)
  state = trainer.init_train_state(model_cfg, optimizer, jax.random.PRNGKey(c.seed), params=params,
                                   mesh=mesh, with_ref_params=t.kl_coef != 0.0)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  train_step = trainer.make_train_step(model_cfg, optimizer, loss_fn, mesh, state_sh,
                                       num_microbatches=t.num_microbatches,
                                       chunk_size=t.logprob_chunk, learning_rate_fn=lr_fn)
  sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                            top_k=c.rollout.top_k, max_tokens=c.rollout.max_tokens,
                            stop_token_ids=tuple(codec.stop_ids), seed=c.seed)
  buckets = tuple(b for b in c.trainer.buckets if b < c.model.max_len) + (c.model.max_len,)
  ref = jax.device_get(state.ref_params) if state.ref_params is not None else None
  parts = Parts(config=c, task=task, codec=codec, model_cfg=model_cfg,
                param_shardings=state_sh.params, train_step=train_step, loss_fn=loss_fn,
                sampling=sampling,
                advantage_fn=experience.make_advantage_fn(t.loss, options=loss_fn.options),
                buckets=buckets, ref_params=ref)
  return parts, state


def make_grad_fn(model_cfg, loss_fn: loss_fn_lib.LossFn, chunk_size: int) -> Callable:
  """Jitted `fn(params, ref_params, batch) -> (grad float32 [P], loss [], aux)`.

  The train step's loss (`trainer.make_train_step`'s forward: `token_logprobs` then `loss_fn`),
  differentiated with respect to every parameter and flattened by `ravel_pytree` (the order of
  `jax.tree.leaves`). ref_params: the frozen KL reference (None when loss_fn has no KL term).
  """
  def fn(params, ref_params, batch):
    lfn = loss_fn
    if lfn.aggregation == "constant" and lfn.normalizer is None:  # as the train step does
      lfn = dataclasses.replace(lfn, normalizer=float(batch.tokens.shape[0] * batch.tokens.shape[1]))

    def loss(p):
      lp = logprobs_lib.token_logprobs(model_cfg, p, batch.tokens, batch.targets, batch.positions,
                                       batch.segment_ids, chunk_size=chunk_size)
      if ref_params is None:
        return lfn(lp, batch)
      ref_lp = jax.lax.stop_gradient(logprobs_lib.token_logprobs(
          model_cfg, ref_params, batch.tokens, batch.targets, batch.positions, batch.segment_ids,
          chunk_size=chunk_size))
      return lfn(lp, batch, ref_lp)

    (value, aux), g = jax.value_and_grad(loss, has_aux=True)(params)
    flat, _ = ravel_pytree(jax.tree.map(lambda x: x.astype(jnp.float32), g))
    return flat, value, aux
  return jax.jit(fn)


def sample_rollouts(parts: Parts, params, version: int, problems: Sequence[Any], seed: int,
                    sampler: Optional[JaxSampler] = None) -> tuple[list, np.ndarray]:
  """G completions of each problem sampled with `params`; (rollouts grouped by problem, rewards
  float32 [P, G]). A fresh sampler of seed `seed` unless one is given (then it keeps its own
  call counter)."""
  c = parts.config
  if sampler is None:
    sampler = JaxSampler(parts.model_cfg, params, c.model.max_len,
                         batch_size=c.rollout.sampler_batch_size,
                         eos_token_ids=parts.codec.stop_ids, seed=seed, policy_version=version)
  else:
    sampler.load_weights(Weights(version=version, params=params, cfg=parts.model_cfg))
  prompts = [parts.codec.encode_prompt(p.prompt) for p in problems]
  groups = sampler.generate(prompts, c.rollout.group_size, parts.sampling)
  return experience.groups_to_rollouts(groups, problems, parts.task, parts.codec,
                                       parts.advantage_fn, list(range(len(groups))))


# ---- the probe ------------------------------------------------------------------------------------

def combined_gradient(parts: Parts, grad_fn: Callable, params, rollouts: Sequence[Any],
                      minibatch: int) -> Optional[np.ndarray]:
  """The gradient of the loss on all `rollouts`, from minibatches of `minibatch` rows.

  Micro-batch accumulation as in `trainer.make_train_step`: the whole batch's gradient is the
  sum of the minibatch gradients weighted by their share of valid tokens ("token_mean") or of rows
  with valid tokens ("sequence_mean"). Reuses the probe's compiled minibatch shape.

  Returns:
    float32 [P], or None when len(rollouts) is not a multiple of `minibatch` or the aggregation is
    "constant" (whose normaliser depends on the whole batch's padded shape).
  """
  agg = parts.loss_fn.aggregation
  if len(rollouts) % minibatch or agg == "constant":
    return None
  total, weights, grads = 0.0, [], []
  for i in range(0, len(rollouts), minibatch):
    batch = collate_lib.collate(rollouts[i:i + minibatch], buckets=parts.buckets,
                                pad_id=parts.codec.pad_id, batch_size=minibatch)
    m = batch.completion_mask > 0
    w = float(m.sum()) if agg == "token_mean" else float(np.sum(m.any(axis=1)))
    flat, _, _ = grad_fn(params, parts.ref_params, batch)
    grads.append(np.asarray(jax.device_get(flat), np.float64))
    weights.append(w)
    total += w
  return sum(w / total * g for w, g in zip(weights, grads)).astype(np.float32)


def train_on_policy(parts: Parts, state, steps: int, keep_versions: set[int], grad_fn: Callable,
                    minibatch: int) -> tuple[Any, dict[int, Any], list[dict], dict]:
  """K on-policy steps (N = B = R) from train state `state` (consumed: the steps donate it);
  returns (the trained state, {version: host params}, per-step rows, check).

  The check compares the norm of the probe's gradient of the first training batch (accumulated
  over minibatches of `minibatch` rows by `combined_gradient`) with the train step's own grad_norm
  on that batch at the same params: their relative difference should be ~1e-6 (float32).
  """
  c, codec = parts.config, parts.codec
  b, g = c.buffer.batch_size, c.rollout.group_size
  prompts_per_step = -(-b // g)
  source = experience.PromptSource(parts.task, c.seed)
  sampler = JaxSampler(parts.model_cfg, jax.tree.map(jnp.copy, state.params), c.model.max_len,
                       batch_size=c.rollout.sampler_batch_size, eos_token_ids=codec.stop_ids,
                       seed=c.seed + TRAIN_SAMPLER_SEED_OFFSET)
  snapshots, rows, check = {}, [], {}
  for step in range(steps + 1):
    if step in keep_versions:
      snapshots[step] = jax.device_get(state.params)
    if step == steps:
      break
    problems = [p for _, p in source.take(prompts_per_step)]
    rollouts, rewards = sample_rollouts(parts, jax.tree.map(jnp.copy, state.params), step, problems,
                                        0, sampler=sampler)
    batch = collate_lib.collate(rollouts[:b], buckets=parts.buckets, pad_id=codec.pad_id,
                                batch_size=b)
    probe_grad = combined_gradient(parts, grad_fn, state.params, rollouts[:b], minibatch) \
        if step == 0 else None
    state, m = parts.train_step(state, batch)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    if step == 0:
      check["train_step_grad_norm"] = m["grad_norm"]
      if probe_grad is None:
        check["skipped"] = "batch size not a multiple of the minibatch, or constant aggregation"
      else:
        check["probe_grad_norm"] = float(np.linalg.norm(probe_grad.astype(np.float64)))
        check["rel_diff"] = abs(check["probe_grad_norm"] / m["grad_norm"] - 1.0)
    rows.append({"step": step + 1, "reward_mean": float(rewards.reshape(-1)[:b].mean()),
                 "loss": m["loss"], "grad_norm": m["grad_norm"],
                 "learning_rate": m.get("learning_rate", math.nan),
                 "entropy": m.get("entropy", math.nan)})
  return state, snapshots, rows, check


def resolve_minibatch(requested: int, batch_size: int, group_size: int) -> int:
  """B for the probe, a multiple of G: 0 -> the config's batch size, -k -> k groups, else as given
  (each rounded down to whole groups, at least one)."""
  b = batch_size if requested == 0 else (-requested * group_size if requested < 0 else requested)
  return max(group_size, (b // group_size) * group_size)


@dataclasses.dataclass(frozen=True)
class ProbePlan:
  """The probe's shape, checked: minibatch B, n minibatches of it (M = n B rollouts) and the
  staleness grid (0 and every requested s in [1, steps]; `dropped` the others)."""
  minibatch: int
  num_minibatches: int
  rollouts: int
  grid: list
  dropped: list


def plan_probe(c, settings: ProbeSettings) -> ProbePlan:
  """The `ProbePlan` of `settings` under config `c`; a ValueError names what to change."""
  g_size = c.rollout.group_size
  b_probe = resolve_minibatch(settings.minibatch, c.buffer.batch_size, g_size)
  n_mb = settings.rollouts // b_probe
  if n_mb < 2:
    raise ValueError(f"rollouts={settings.rollouts} gives {n_mb} minibatch(es) of B={b_probe}: need "
                     ">= 2 to estimate a variance; raise --rollouts or lower --minibatch")
  m_rollouts = n_mb * b_probe
  if b_probe > m_rollouts // g_size:
    raise ValueError(f"minibatch B={b_probe} > {m_rollouts // g_size} probe prompts: the 'spread' "
                     "layout needs B different prompts per minibatch; raise --rollouts")
  grid = sorted({int(s) for s in settings.staleness if 0 <= int(s) <= settings.steps} | {0})
  if len(grid) < 2:
    raise ValueError(f"staleness grid {settings.staleness} with steps={settings.steps} keeps {grid}: "
                     "need 0 and at least one s in [1, steps]")
  dropped = sorted(set(int(s) for s in settings.staleness) - set(grid))
  return ProbePlan(b_probe, n_mb, m_rollouts, grid, dropped)


def probe_gradients(c, parts: Parts, grad_fn: Callable, plan: ProbePlan, snapshots: dict,
                    k_steps: int, log: Callable[[str], None]):
  """At theta_T (the snapshot of step `k_steps`): per staleness s of the grid, rollouts sampled
  with the params of step T - s, the minibatch gradients of each layout, their Gram matrices
  (and those against s = 0), and the rollouts' statistics. Returns (grams, cross, stats,
  number of parameters)."""
  g_size, b_probe, n_mb = c.rollout.group_size, plan.minibatch, plan.num_minibatches
  # Params in the train state's layout, so the sampler and gradient reuse their compilations.
  param_sh = parts.param_shardings
  theta_t = jax.device_put(snapshots[k_steps], param_sh)
  probe_problems = [p for _, p in experience.PromptSource(
      parts.task, c.seed + PROBE_PROMPT_SEED_OFFSET).take(plan.rollouts // g_size)]
  grams = {lay: {} for lay in LAYOUTS}     # layout -> s -> float64 [n, n]
  cross = {lay: {} for lay in LAYOUTS}     # layout -> s -> <g_b(s), g_b'(0)>, float64 [n, n]
  grads0, stats = {}, []
  for s in plan.grid:
    t_s = time.perf_counter()
    rollouts, rewards = sample_rollouts(parts, jax.device_put(snapshots[k_steps - s], param_sh),
                                        k_steps - s, probe_problems,
                                        c.seed + PROBE_SAMPLER_SEED_OFFSET)
    aux_rows = []
    for lay in LAYOUTS:
      order = layout_order(len(probe_problems), g_size, lay)
      grads = []
      for i in range(n_mb):
        chunk = [rollouts[j] for j in order[i * b_probe:(i + 1) * b_probe]]
        batch = collate_lib.collate(chunk, buckets=parts.buckets, pad_id=parts.codec.pad_id,
                                    batch_size=b_probe)
        flat, _, aux = grad_fn(theta_t, parts.ref_params, batch)
        grads.append(np.asarray(jax.device_get(flat)))
        if lay == "groups":
          aux_rows.append({k: float(v) for k, v in jax.device_get(aux).items()})
      grads = np.stack(grads)                       # [n, P] float32
      if s == 0:
        grads0[lay] = grads
      grams[lay][s] = noise_stats.gram(grads)
      cross[lay][s] = noise_stats.gram(grads, grads0[lay])
    adv = np.array([r.advantage for r in rollouts])
    lengths = np.array([len(r.completion_tokens) for r in rollouts])
    stats.append({
        "staleness": s, "policy_version": k_steps - s,
        "reward_mean": float(rewards.mean()), "zero_advantage_fraction": float(np.mean(adv == 0)),
        "completion_tokens_mean": float(lengths.mean()),
        **{f"{k}_mean": float(np.mean([a[k] for a in aux_rows]))
           for k in ("clip_fraction", "ratio_mean", "ratio_max", "tis_weight_mean")
           if k in aux_rows[0]},
        "seconds": time.perf_counter() - t_s,
    })
    log(f"  staleness {s:3d}: {time.perf_counter() - t_s:.1f} s")
  return grams, cross, stats, int(grads0["groups"].shape[1])


def staleness_rows(plan: ProbePlan, grams: dict, stats: list, main_est: dict,
                   spread: dict) -> list[dict]:
  """One row per staleness: the rollouts' statistics, sigma^2 (both layouts), the bias and the
  mean gradient's norm, with their intervals."""
  rows = []
  sigma2 = main_est["sigma2"]
  for i, s in enumerate(plan.grid):
    mean_sq = noise_stats.mean_sq_norm_from_gram(grams["groups"][s])   # ||g_bar(s)||^2
    rows.append({
        **stats[i],
        "var_minibatch": float(main_est["var"][i]), "sigma2": float(sigma2[i]),
        "sigma2_ci": main_est["sigma2_ci"][i],
        "sigma2_ratio_to_s0": float(main_est["ratio"][i]),
        "sigma2_ratio_ci": main_est["ratio_ci"][i],
        "bias": float(math.sqrt(max(main_est["bias_sq"][i], 0.0))),
        "bias_sq_debiased": float(main_est["bias_sq"][i]),
        "bias_raw": float(math.sqrt(max(main_est["bias_raw_sq"][i], 0.0))),
        "bias_ci": main_est["bias_ci"][i],
        "mean_grad_norm": float(math.sqrt(max(mean_sq, 0.0))),
        "mean_grad_norm_debiased": float(math.sqrt(max(
            mean_sq - main_est["var"][i] / plan.num_minibatches, 0.0))),
        "sigma2_spread": float(spread["sigma2"][i]), "sigma2_spread_ci": spread["sigma2_ci"][i],
        "sigma2_spread_ratio_to_s0": float(spread["ratio"][i]),
    })
  return rows


def monotonicity(grid: list, sigma2, rows: list[dict]) -> dict:
  """Is each sigma^2(s) above sigma^2(0), and is the curve non-decreasing?"""
  steps_up = [bool(sigma2[i + 1] >= sigma2[i]) for i in range(len(grid) - 1)]
  return {
      "non_decreasing_point_estimates": all(steps_up),
      "increments_non_negative": steps_up,
      "ratio_ci_excludes_1_above": [s for r, s in zip(rows, grid) if s > 0 and r["sigma2_ratio_ci"][0] > 1],
      "ratio_ci_excludes_1_below": [s for r, s in zip(rows, grid) if s > 0 and r["sigma2_ratio_ci"][1] < 1],
  }


def fit_record(e: dict) -> Optional[dict]:
  """A layout estimate's power-law fit as the result record holds it (None: no fit)."""
  f = e["fit"]
  if f is None:
    return None
  return {"alpha": f.alpha, "tau": noise_stats.finite_or_str(f.tau), "r2": f.r2,
          "num_points": f.num_points, "alpha_ci": e["alpha_ci"],
          "on": "staleness >= 1 (s = 0 left out: the power law is 0 there)",
          "of": "sigma = sqrt(sigma2 per rollout), tau in steps"}


def config_record(c) -> dict:
  """The probed run's settings, as the result record holds them (with the loss's options, e.g.
  GRPO's eps_low and eps_high: `algorithms.options_from_config`)."""
  return {
      "task": c.task.name, "model_path": c.model.path or f"preset:{c.model.preset}",
      "loss": c.trainer.loss, "aggregation": c.trainer.aggregation,
      "learning_rate": c.trainer.learning_rate, "schedule": c.trainer.schedule,
      "warmup_steps": c.trainer.warmup_steps, "total_steps": c.total_steps,
      "batch_size": c.buffer.batch_size, "group_size": c.rollout.group_size,
      "max_tokens": c.rollout.max_tokens, "temperature": c.rollout.temperature,
      **dataclasses.asdict(algorithms.options_from_config(c.trainer)),
      "mu": float(c.scheduler.mu), "seed": c.seed,
  }


def run_probe(c, settings: ProbeSettings, log: Callable[[str], None] = print) -> dict:
  """Trains, probes every staleness and returns the result record (see the module docstring)."""
  t_start = time.perf_counter()
  plan = plan_probe(c, settings)
  grid, k_steps = plan.grid, settings.steps

  with tempfile.TemporaryDirectory(prefix="probe_sigma_") as workdir:
    parts, state = build_parts(c, workdir)
  grad_fn = make_grad_fn(parts.model_cfg, parts.loss_fn, c.trainer.logprob_chunk)
  log(f"training {k_steps} on-policy steps (B = R = N = {c.buffer.batch_size}, "
      f"G = {c.rollout.group_size}, lr {c.trainer.learning_rate:g} {c.trainer.schedule}) ...")
  t0 = time.perf_counter()
  _, snapshots, train_rows, check = train_on_policy(parts, state, k_steps,
                                                    {k_steps - s for s in grid}, grad_fn,
                                                    plan.minibatch)
  train_s = time.perf_counter() - t0
  log(f"  {train_s:.1f} s; reward mean first/last step {train_rows[0]['reward_mean']:.3f} / "
      f"{train_rows[-1]['reward_mean']:.3f}; gradient check (relative difference of norms): "
      f"{check.get('rel_diff', check.get('skipped'))}")

  t0 = time.perf_counter()
  grams, cross, stats, n_params = probe_gradients(c, parts, grad_fn, plan, snapshots, k_steps, log)
  probe_s = time.perf_counter() - t0

  rng = np.random.default_rng(settings.seed)
  est = {lay: noise_stats.estimate_layout(grams[lay], cross[lay], grid, plan.minibatch,
                                          settings.bootstrap, rng)
         for lay in LAYOUTS}
  main_est, spread = est["groups"], est["spread"]
  sigma2 = main_est["sigma2"]
  fit_shift = (noise_stats.fit_power_law([s + 1 for s in grid], sigma2)
               if np.all(sigma2 > 0) else None)
  rows = staleness_rows(plan, grams, stats, main_est, spread)
  mu = float(c.scheduler.mu)
  return {
      "config": config_record(c),
      "settings": {"steps": k_steps, "rollouts": plan.rollouts, "minibatch": plan.minibatch,
                   "num_minibatches": plan.num_minibatches, "staleness": grid,
                   "staleness_dropped": plan.dropped,
                   "bootstrap": settings.bootstrap, "interval": "95% percentile bootstrap",
                   "num_params": n_params},
      "units": {"sigma2": "per rollout: B x var_minibatch, squared L2 norm of d loss / d params",
                "var_minibatch": "variance of a B-rollout minibatch gradient (squared L2 norm)",
                "bias": "||E g(s) - E g(0)|| (L2 norm of d loss / d params), debiased",
                "mean_grad_norm": "||g_bar(s)|| at theta_T; _debiased: sqrt(||g_bar||^2 - var/n), "
                                  "an estimate of ||E g(s)||",
                "staleness": "optimizer steps between theta_T and the sampling params"},
      "training": train_rows, "grad_check": check,
      "rows": rows, "fit": fit_record(main_est), "fit_spread": fit_record(spread),
      "fit_shifted": None if fit_shift is None else {
          "alpha": fit_shift.alpha, "tau_plus_1": noise_stats.finite_or_str(fit_shift.tau),
          "r2": fit_shift.r2,
          "of": "sigma against staleness + 1, every point"},
      "monotone": monotonicity(grid, sigma2, rows),
      "design": noise_stats.design_table(mu, grid, sigma2, main_est["fit"]),
      "design_spread": noise_stats.design_table(mu, grid, spread["sigma2"], spread["fit"]),
      "wall_seconds": {"train": train_s, "probe": probe_s, "total": time.perf_counter() - t_start},
  }
