"""Held-out evaluation: pass@1 at low temperature, unbiased pass@k, and policy entropy.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n samples of
which c are correct, the unbiased estimate of P(at least one of k samples is correct) is
1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i), computed here as a product (no huge
binomials).

Where evaluation runs (`config.eval.backend`, resolved by `rollout.backend_table.resolve_eval`):
"trainer" samples with a `JaxSampler` on the trainer devices (its own KV cache beside the train
state); "engines" sends the same requests to the rollout workers (`engine_jobs`: one job per
request, run by a worker between two rollout requests, at the evaluated policy version); "auto" is
"engines" when the rollout backend's record says so (vLLM), else "trainer". The requests and their
scoring are the same either way.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxreplay.data.experience import score_groups
from jaxreplay.rollout import multiturn
from jaxreplay.rollout.base import Group, SamplingParams, generate_request

GenerateFn = Callable[..., list[Group]]
# One generate call's arguments: (prompts int32 [Lp] each, n samples per prompt, settings), and
# for a multi-turn task a fourth, its `multiturn.Episodes` (`base.generate_request`'s arguments).
Request = tuple
# Runs requests (in any order, possibly concurrently) and returns their groups in request order.
GenerateManyFn = Callable[[list[Request]], list[list[Group]]]

def engine_jobs(requests: Sequence[Request], first_call: int) -> list[Callable[[Any], list[Group]]]:
  """One job per request for a rollout worker: `job(worker) -> worker.generate(*request)`.

  A worker that counts its calls (`RolloutWorker.call_count` not None: the JAX sampler's noise
  stream, which a resumed simulated run continues) draws job j's noise from call index
  `first_call + j` and gets its own count back afterwards, so evaluation leaves the rollouts' noise
  untouched and its own noise follows the checkpointed eval counter (`first_call`). Other workers
  (vLLM: call_count None) just generate.
  """
  def make(j: int, request: Request) -> Callable[[Any], list[Group]]:
    def job(worker) -> list[Group]:
      if worker.call_count is None:
        return generate_request(worker, *request)
      saved = worker.call_count
      worker.call_count = first_call + j
      try:
        return generate_request(worker, *request)
      finally:
        worker.call_count = saved
    return job
  return [make(j, r) for j, r in enumerate(requests)]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem from `n` samples with `c` correct (1 <= k <= n)."""
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_per_problem(correct: np.ndarray, k: int) -> np.ndarray:
  """float64 [P] unbiased pass@k of each row of `correct` (bool [P, n], one row per problem)."""
  correct = np.asarray(correct, dtype=bool)
  if correct.ndim != 2:
    raise ValueError(f"correct must be [P, n], got shape {correct.shape}")
  n = correct.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
  c = correct.sum(axis=1)
  # logs[j] = sum_{i=k+1}^{j} log(1 - k/i) for j >= k; then prod_{i=n-c+1}^{n} = exp(logs[n] - logs[n-c]).
  i = np.arange(k + 1, n + 1, dtype=np.float64)
  logs = np.zeros(n + 1)
  logs[k + 1:] = np.cumsum(np.log1p(-k / i))
  fails = n - c
  log_prod = logs[n] - logs[np.maximum(fails, k)]
  return np.where(fails < k, 1.0, -np.expm1(log_prod))


def pass_at_k_array(correct: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
  """{k: mean over problems of unbiased pass@k} for `correct` bool [P, n]."""
  return {int(k): float(pass_at_k_per_problem(correct, k).mean()) for k in ks}


def _requests(prompts: list[np.ndarray], n: int, sampling: SamplingParams,
              batch_size: Optional[int], problems: Sequence = (),
              episodes: Optional[multiturn.EpisodeRunner] = None) -> list[Request]:
  step = batch_size or len(prompts)
  if episodes is None:
    return [(prompts[start:start + step], n, sampling) for start in range(0, len(prompts), step)]
  return [(prompts[start:start + step], n, sampling,
           multiturn.Episodes(episodes, tuple(problems[start:start + step])))
          for start in range(0, len(prompts), step)]


def _collect(requests: Sequence[Request], outputs: Sequence[list[Group]]) -> list[Group]:
  """The groups of `requests` (one per prompt, in prompt order), checked against the requests."""
  groups: list[Group] = []
  for (chunk, n, *_), out in zip(requests, outputs):
    out = sorted(out, key=lambda g: g.prompt_index)
    if len(out) != len(chunk) or any(len(g.completions) != n for g in out):
      raise ValueError(f"generate_fn returned {len(out)} groups of sizes "
                       f"{[len(g.completions) for g in out][:8]} for {len(chunk)} prompts x n={n}")
    groups.extend(out)
  return groups


def evaluate(generate_fn: Optional[GenerateFn], task, problems: Sequence, codec, n_samples: int = 16,
             ks: Sequence[int] = (1, 2, 4, 8, 16), temperature_pass1: float = 0.1,
             n_pass1: int = 1, temperature_passk: float = 1.0, max_tokens: int = 64,
             top_p: float = 1.0, seed: int = 0, batch_size: Optional[int] = None,
             success_threshold: float = 1.0, prefix: str = "eval/",
             generate_many: Optional[GenerateManyFn] = None,
             episodes: Optional[multiturn.EpisodeRunner] = None,
             per_problem: Optional[dict] = None) -> dict[str, float]:
  """Evaluates a policy on held-out `problems`.

  Args:
    generate_fn: `worker.generate(prompts, n, SamplingParams) -> list[Group]` (one group per prompt),
      called once per request, pass@1 requests first (None when `generate_many` is given).
    task: scores completions with `task.score_batch(texts, problems)` (float32 [N]).
    problems: held-out problems (`.prompt`, `.answer`).
    codec: a `TextCodec` (encode_prompt / decode / stop_ids).
    n_samples: samples per problem at `temperature_passk` for pass@k and entropy (0 skips them).
    ks: the k of pass@k, each <= n_samples.
    temperature_pass1, n_pass1: pass@1 is the mean success of `n_pass1` samples per problem at
      this temperature (0.1 in the paper: near-greedy).
    success_threshold: a sample is correct when its reward >= this.
    batch_size: prompts per generate_fn call (None: all at once).
    generate_many: runs the list of all requests (pass@1 ones, then pass@k ones) at once, e.g. on
      several rollout engines in parallel, and returns their groups in request order; replaces
      `generate_fn`.
    episodes: a multi-turn task's runner: each request carries its `Episodes` (a fourth element,
      `base.generate_request`'s), its completions are trajectories scored by their environment,
      and the pass@1 trajectories' statistics are added under prefix + "env/" (`multiturn.means`).
    per_problem: an optional output: filled with "pass1_correct" (int64 [P]: each problem's correct
      low-temperature samples, of "n_pass1"), "passk_correct" (int64 [P]: its correct samples of
      the "n_samples" at `temperature_passk`; only when n_samples > 0), "n_pass1", "n_samples" (ints).
      The returned pass@1 is pass1_correct.sum() / (P n_pass1) and pass@k the mean over problems of
      `pass_at_k_per_problem` of the passk_correct counts (`eval_problems.jsonl` records them).

  Returns {prefix + key: float}: "pass@1" (low temperature), "pass@{k}" for k > 1 and
  "pass@1_t{T}" for k = 1 (from the temperature-T samples), "entropy" (mean negative log-prob of
  the sampled tokens at temperature T: a Monte-Carlo estimate of the per-token policy entropy
  when T = 1), "mean_completion_tokens", "truncated_fraction" (ended by max_tokens),
  "reward_mean" (temperature-T samples), "num_problems", "num_samples", "seconds".
  """
  if not problems:
    raise ValueError("evaluate: no problems")
  ks = sorted({int(k) for k in ks}) if n_samples else []
  if ks and (ks[0] < 1 or ks[-1] > n_samples):
    raise ValueError(f"ks={ks} must lie in [1, n_samples={n_samples}]")
  if n_pass1 < 1:
    raise ValueError(f"n_pass1={n_pass1} must be >= 1")
  t0 = time.perf_counter()
  problems = list(problems)
  prompts = [codec.encode_prompt(p.prompt) for p in problems]
  base = dict(max_tokens=max_tokens, top_p=top_p, stop_token_ids=tuple(codec.stop_ids))

  low = SamplingParams(temperature=temperature_pass1, seed=seed, **base)
  low_requests = _requests(prompts, n_pass1, low, batch_size, problems, episodes)
  high_requests = []
  if n_samples:
    high = SamplingParams(temperature=temperature_passk, seed=seed + 1, **base)
    high_requests = _requests(prompts, n_samples, high, batch_size, problems, episodes)
  requests = low_requests + high_requests
  if generate_many is not None:
    outputs = list(generate_many(requests))
    if len(outputs) != len(requests):
      raise ValueError(f"generate_many returned {len(outputs)} results for {len(requests)} requests")
  elif generate_fn is not None:
    outputs = [generate_fn(*r) for r in requests]
  else:
    raise ValueError("evaluate needs generate_fn or generate_many")
  groups1 = _collect(low_requests, outputs[:len(low_requests)])
  rewards1 = score_groups(groups1, problems, task, codec)
  correct1 = (rewards1 >= success_threshold).reshape(len(problems), n_pass1)
  out = {"pass@1": float(correct1.mean())}
  counts = {"n_pass1": int(n_pass1), "n_samples": int(n_samples),
            "pass1_correct": correct1.sum(axis=1, dtype=np.int64)}
  if episodes is not None:
    out.update(multiturn.means(multiturn.episode_infos(groups1), prefix="env/"))

  if n_samples:
    groups = _collect(high_requests, outputs[len(low_requests):])
    rewards = score_groups(groups, problems, task, codec)
    logprobs = [c.logprobs for g in groups for c in g.completions]
    correct = (rewards >= success_threshold).reshape(len(problems), n_samples)
    counts["passk_correct"] = correct.sum(axis=1, dtype=np.int64)
    for k, v in pass_at_k_array(correct, ks).items():
      out[f"pass@{k}" if k > 1 else f"pass@1_t{temperature_passk:g}"] = v
    # the policy's tokens (a trajectory's observations carry log-prob 0 and are not counted)
    num_tokens = sum(c.policy_tokens for g in groups for c in g.completions)
    total_nll = -sum(float(np.sum(lp, dtype=np.float64)) for lp in logprobs)
    out["entropy"] = total_nll / max(num_tokens, 1)
    out["mean_completion_tokens"] = num_tokens / len(logprobs)
    out["truncated_fraction"] = float(np.mean(
        [c.finish_reason == "length" for g in groups for c in g.completions]))
    out["reward_mean"] = float(rewards.mean())
    out["num_samples"] = float(n_samples)
  out["num_problems"] = float(len(problems))
  out["seconds"] = time.perf_counter() - t0
  if per_problem is not None:
    per_problem.update(counts)
  return {prefix + k: v for k, v in out.items()}
