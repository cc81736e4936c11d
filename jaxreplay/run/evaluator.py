"""The run's held-out evaluation as a hook: when (`EvalGrid`), where (`eval.backend`) and its
resumable counters.

`Evaluator.due` is the hook's rule (`hooks.TrainerHooks.add_hook(..., due=evaluator.due)`): the
eval grid's compute points (or every `eval.every` steps), the run's last step always. `evaluate`
samples where config.eval.backend says: "trainer", a `JaxSampler` on the trainer devices loaded
with the current params; "engines", the rollout workers through the schedule (`run_jobs`: the
local worker, or the async pool's free runners between requests) at the current step's weights.
Both count their generate calls (`calls`, the host state's "eval_calls"), from which the JAX
samplers draw their eval noise, so a resumed simulated run evaluates as the uninterrupted one.
With `eval.per_problem` each evaluation's per-problem counts go to the run's
`eval_problems.ProblemLog` (`<workdir>/eval_problems.jsonl`, `parts.telemetry.problems`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from jaxreplay.infra import sharding
from jaxreplay.rollout.base import Weights, generate_request
from jaxreplay.run import eval_grid as eval_grid_lib
from jaxreplay.run import evaluation

# (weights, jobs) -> the jobs' results, run on the schedule's rollout workers at `weights`.
RunJobs = Callable[[Weights, Sequence[Callable[[Any], Any]]], list]


class Evaluator:
  """Held-out evaluation of one run (module docstring).

  Args:
    parts: the run's `build.Parts` (the task, codec and held-out problems; the eval sampler, None
      when the engines evaluate; the metrics' compute axis; the per-problem log
      `telemetry.problems`, None when eval.per_problem is off).
  """

  def __init__(self, parts):
    self.parts, self.config = parts, parts.config
    self.sampler = parts.generation.eval_sampler  # eval.backend="trainer"; None: the engines
    self.grid = eval_grid_lib.EvalGrid.from_config(parts.config.eval)
    self.problem_log = parts.telemetry.problems  # eval_problems.ProblemLog, or None
    self.last: dict[str, float] = {}  # the newest evaluation's metrics
    self._engine_calls = 0  # generate calls of evaluations on the engines

  @property
  def calls(self) -> int:
    """Generate calls of every evaluation so far (the host state's "eval_calls")."""
    return self.sampler.call_count if self.sampler is not None else self._engine_calls

  @calls.setter
  def calls(self, value: int) -> None:
    if self.sampler is not None:
      self.sampler.call_count = int(value)
    else:
      self._engine_calls = int(value)

  @property
  def passk_due(self) -> bool:
    """Whether the next evaluation draws the pass@k samples (`EvalGrid.passk_due`)."""
    return self.grid.passk_due

  @passk_due.setter
  def passk_due(self, value: bool) -> None:
    self.grid.passk_due = bool(value)

  def due(self, info) -> bool:
    """The hook's rule: whether step `info.step` is evaluated (`EvalGrid.due`; reads the compute
    axis only with a compute grid)."""
    return self.grid.due(info.step, info.finished, self.parts.telemetry.metrics.compute_seconds)

  def start(self) -> bool:
    """Whether step 0 (the initial policy) is evaluated (`EvalGrid.start`)."""
    return self.grid.start()

  def evaluate(self, step: int, policy_params: Any, eval_weights: Callable[[], Weights],
               run_jobs: RunJobs, job_parallelism: int) -> dict[str, float]:
    """Evaluates the policy of `step` on the held-out problems (`evaluation.evaluate`).

    Args:
      step: the policy version. policy_params: its params (LoRA: merged on the fly), for the
        trainer's sampler. eval_weights: () -> its `Weights` for the engines.
      run_jobs, job_parallelism: the schedule's `run_jobs` (bound to the pipeline) and how many
        workers run jobs at once: with several, the problems are split into one chunk each.
    """
    c, data = self.config, self.parts.data
    n_samples = c.eval.n_samples if self.grid.passk_due else 0  # eval.passk_grid: pass@1 only
    problems = data.eval_problems
    if not n_samples and c.eval.get("pass1_problems", 0):  # pass@1-only points: a subset
      problems = problems[:int(c.eval.pass1_problems)]
    settings = dict(n_samples=n_samples, ks=tuple(c.eval.ks),
                    temperature_pass1=c.eval.temperature_pass1, n_pass1=4,
                    temperature_passk=c.eval.temperature_passk, max_tokens=c.rollout.max_tokens,
                    top_p=c.eval.top_p, seed=c.seed + 7919, episodes=data.intake.episodes,
                    per_problem={})
    if self.sampler is not None:  # eval.backend="trainer"
      self.sampler.load_weights(Weights(step, params=sharding.local_params(policy_params)))
      self.last = evaluation.evaluate(functools.partial(generate_request, self.sampler),
                                      data.task, problems, data.codec, **settings)
    else:
      self.last = self._on_engines(problems, settings, eval_weights, run_jobs, job_parallelism)
    # eval.refine_levels: the grid ahead (the compute axis where this step ended: its pace)
    self.grid.observe(self.last.get("eval/pass@1"), self.grid.compute_at_step_end)
    if self.problem_log is not None:
      self.problem_log.write(step, self.parts.telemetry.metrics.compute_seconds(),
                             settings["per_problem"], [p.prompt for p in problems])
    return self.last

  def _on_engines(self, problems, settings, eval_weights, run_jobs, job_parallelism):
    """`evaluation.evaluate` as jobs on the schedule's rollout workers (`evaluate`'s args)."""
    data = self.parts.data
    weights = eval_weights()
    first_call = self._engine_calls

    def generate_many(requests):
      out = run_jobs(weights, evaluation.engine_jobs(requests, first_call))
      self._engine_calls = first_call + len(requests)
      return out

    parallel = max(int(job_parallelism), 1)
    batch_size = -(-len(problems) // parallel) if parallel > 1 else None
    return evaluation.evaluate(None, data.task, problems, data.codec, batch_size=batch_size,
                               generate_many=generate_many, **settings)
