"""What every schedule shares: the `Hooks` protocol, the `Schedule` facts, the virtual clock
(`SimState`) and its `GenerationCost`, the in-process `LocalWorker`, and the encoding of in-flight
groups for checkpoints. The schedules themselves: `simulated`, `sync`, `async_` (package docstring).
"""
from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from absl import logging
import numpy as np

from jaxreplay.rollout.base import (Completion, Group, PromptBatch, RolloutWorker, SamplingParams,
                                    Weights)

MakeWorker = Callable[[int, Weights], RolloutWorker]  # (worker index, weights) -> a new worker
Job = Callable[[RolloutWorker], Any]  # runs on one worker between two requests


class Hooks(Protocol):
  """The pipeline's side of a schedule."""

  intake: Any  # `jaxreplay.data.experience.Intake`: next_request / score / deliver / dropped

  def done(self) -> bool:
    """Whether the run has finished (total_steps, or the compute budget, reached at a step end)."""

  def latest_weights(self) -> Weights:
    """The newest published weights (workers sample with these)."""

  def generated(self, groups: list[Group], seconds: float) -> None:
    """Accounts one generate call (measured seconds); may compare sampler and trainer log-probs."""

  def can_train(self) -> bool:
    """Whether the buffer holds enough rollouts for a batch."""

  def train_step(self, now: float) -> Any:
    """Samples a batch and takes one gradient step; returns a handle for `finish_step`."""

  def sample_rollouts(self) -> list:
    """The next batch's rollouts, sampled from the buffer (`train_step` = `train_on` of these)."""

  def train_on(self, rollouts: list, now: float) -> Any:
    """One gradient step on the batch of `rollouts`; returns a handle for `finish_step`."""

  def train_share(self, handle: Any) -> float:
    """The step's share of a full step's training cost (its rollouts / B: 1, or 1 / m for a
    minibatch of trainer.ppo_minibatches m); the virtual clock charges it."""

  def publish_if_due(self, handle: Any) -> Optional[Weights]:
    """Publishes the new weights when a refresh is due; returns them (None when not due)."""

  def finish_step(self, handle: Any, now: float) -> None:
    """Evaluates, logs the metrics row and checkpoints when due."""


class Schedule(abc.ABC):
  """The contract of a schedule, asked by the code that only has the config (`schedule_class(kind)`)
  or the schedule, instead of testing `scheduler.kind` strings or `hasattr`.

  Class-level facts:
    kind: its `config.scheduler.kind`.
    virtual_time: it runs on the simulated clock (`SimState`): the run's compute axis is that
      clock's device-seconds, and the metrics rows carry sim/* (simulated, sync). False: measured
      wall time and device-seconds (async).
    mismatch_at_generation: generation and training interleave on one thread, so the sampler /
      trainer log-prob comparison checks fresh groups when they are generated; False: it checks
      the fresh rows of a training batch (the workers run beside the trainer).
    leader_owns_workers: with several trainer processes, process 0 alone drives the rollout
      workers and the buffer and the others follow it (async); False: every process runs the
      schedule itself.
    job_parallelism: how many workers may run jobs (`run_jobs`) at once.
  What every schedule does: `run(hooks)` (until `hooks.done()`), `run_jobs(hooks, weights, fns)`
  (jobs on its rollout workers at `weights`: the engine evaluation), `close()` (releases the
  workers, also when `run` never started), and its checkpointed state: `state_dict()` (None:
  nothing of its own to save, the default) / `load_state_dict(state)`.
  """

  kind: str = ""
  virtual_time: bool = False
  mismatch_at_generation: bool = False
  leader_owns_workers: bool = False
  job_parallelism: int = 1

  @classmethod
  def num_actors(cls, config) -> int:
    """Rollout engines this schedule drives at once (Ray actors under rollout.placement="ray"):
    one local worker generates for every virtual one unless the schedule says otherwise."""
    del config
    return 1

  @classmethod
  def gamma(cls, config, sim_state: "SimState") -> Optional[float]:
    """The compute per update over the on-policy baseline's (1 + mu) on the simulated clock
    (sim/gamma); None for a schedule without virtual time."""
    del config, sim_state
    return None

  @classmethod
  def from_parts(cls, parts) -> "Schedule":
    """The schedule of a built run (`jaxreplay.run.build.Parts`); every schedule defines it."""
    raise TypeError(f"{cls.__name__} does not define from_parts: a schedule builds itself from "
                    "the run's parts (see SimulatedScheduler.from_parts)")

  @abc.abstractmethod
  def run(self, hooks: Hooks) -> None:
    """Runs the schedule until `hooks.done()`."""

  @abc.abstractmethod
  def run_jobs(self, hooks: Hooks, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Runs each job on a rollout worker at `weights`; returns their results in order."""

  def close(self) -> None:
    """Releases the workers (also when `run` never started)."""

  def state_dict(self) -> Optional[dict[str, Any]]:
    """The schedule's own state for a checkpoint (the host state's "scheduler"); None: none."""
    return None

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores a checkpoint's "scheduler" state. A schedule without state of its own was
    resumed from another schedule's checkpoint (a simulated run's in-flight requests): their
    prompts are generated again."""
    del state
    logging.info("the checkpoint's in-flight simulated requests are generated again under "
                 "scheduler.kind=%r", self.kind)


@dataclasses.dataclass
class SimState:
  """The virtual clock; saved with checkpoints so a resumed run continues its timeline."""
  clock: float = 0.0
  generation_device_seconds: float = 0.0
  training_device_seconds: float = 0.0
  requests: int = 0
  reference_tokens: float = 0.0  # the calibration length of `GenerationCost` (0 = not yet set)
  # scheduler.generation_batch > 1 (`LocalWorker`): rollouts generated ahead of their request's
  # start, and those of them discarded (weights newer at the start, or another request came).
  speculative_rows: int = 0
  speculative_discarded: int = 0
  # Regime diagnostics charged to the run's compute (log.charge_diagnostics, `run.regime`): priced
  # device-seconds, part of compute_seconds, not of the clock nor of generation / training.
  diagnostics_device_seconds: float = 0.0


class GenerationCost:
  """Virtual device-seconds of generating groups: a prefill part per rollout, a decode part per token.

    seconds = g * (prefill_fraction * n + (1 - prefill_fraction) * tokens / L)
  for n rollouts holding `tokens` generated tokens in all; g = `seconds_per_rollout` is the cost of a
  rollout of the reference length L, so B rollouts of length L cost mu training steps when
  g = mu * train_seconds_per_step / B. L is `state.reference_tokens`; when it is 0 (not given) the
  first call sets it to the mean completion length of its groups (saved with the clock, so a resumed
  run keeps it).
  """

  def __init__(self, seconds_per_rollout: float, prefill_fraction: float, state: SimState):
    if seconds_per_rollout <= 0:
      raise ValueError("simulated costs must be > 0: set config.scheduler.mu and "
                       "config.scheduler.train_seconds_per_step")
    if not 0.0 <= prefill_fraction < 1.0:
      raise ValueError(f"prefill_fraction={prefill_fraction} must be in [0, 1)")
    self.seconds_per_rollout, self.prefill_fraction, self.state = (
        float(seconds_per_rollout), float(prefill_fraction), state)

  def __call__(self, groups: list[Group]) -> float:
    n = sum(len(g.completions) for g in groups)
    tokens = sum(len(c.tokens) for g in groups for c in g.completions)
    if self.state.reference_tokens <= 0:
      self.state.reference_tokens = max(tokens / max(n, 1), 1.0)
    f = self.prefill_fraction
    return self.seconds_per_rollout * (f * n + (1.0 - f) * tokens / self.state.reference_tokens)


def encode_group(group: Group) -> dict[str, Any]:
  """A `Group` as checkpoint host state (numpy arrays, ints, strings)."""
  return {"prompt_tokens": np.asarray(group.prompt_tokens),
          "tokens": [np.asarray(c.tokens) for c in group.completions],
          "logprobs": [np.asarray(c.logprobs) for c in group.completions],
          "finish_reasons": [str(c.finish_reason) for c in group.completions],
          "policy_version": int(group.policy_version), "prompt_index": int(group.prompt_index)}


def decode_group(state: dict[str, Any]) -> Group:
  """Inverse of `encode_group`."""
  completions = [Completion(np.asarray(t), np.asarray(lp), str(f)) for t, lp, f in
                 zip(state["tokens"], state["logprobs"], state["finish_reasons"])]
  return Group(np.asarray(state["prompt_tokens"]), completions, int(state["policy_version"]),
               int(state["prompt_index"]))


@dataclasses.dataclass
class _Ahead:
  """A request generated before it started (`LocalWorker`, generation_batch > 1): its prompt
  indices, settings, the weights version it was sampled at, and its groups."""
  version: int
  indices: tuple[int, ...]
  n: int
  sampling: SamplingParams
  groups: list[Group]

  def serves(self, batch: PromptBatch, version: int) -> bool:
    """Whether these are the groups `batch` gets when it starts at `version`."""
    return (self.version == version and self.indices == _indices(batch) and self.n == batch.n
            and self.sampling == batch.sampling and len(self.groups) == len(batch.prompts)
            and all(np.array_equal(g.prompt_tokens, p)
                    for g, p in zip(self.groups, batch.prompts)))

  @property
  def rows(self) -> int:
    return sum(len(g.completions) for g in self.groups)

  def state_dict(self, request: int) -> dict[str, Any]:
    return {"request": int(request), "version": int(self.version),
            "indices": [int(i) for i in self.indices], "n": int(self.n),
            "sampling": dataclasses.asdict(self.sampling),
            "groups": [encode_group(g) for g in self.groups]}

  @classmethod
  def from_state(cls, state: dict[str, Any]) -> "_Ahead":
    sampling = dict(state["sampling"])
    sampling["stop_token_ids"] = tuple(int(t) for t in sampling["stop_token_ids"])
    return cls(int(state["version"]), tuple(int(i) for i in state["indices"]), int(state["n"]),
               SamplingParams(**sampling), [decode_group(g) for g in state["groups"]])


def _indices(batch: PromptBatch) -> tuple[int, ...]:
  """The prompt indices of an intake request (`meta`: (index, problem) pairs)."""
  return tuple(int(i) for i, _ in batch.meta)


def upcoming_requests(intake, batch: PromptBatch, count: int) -> list[PromptBatch]:
  """The `count` requests the intake is expected to hand out after `batch`: the next prompt
  indices after its last, in requests of its size (what `Intake.next_request` takes from the
  prompt cursor when no prompt is re-queued). A prediction: `LocalWorker` serves one only to the
  request that turns out to equal it."""
  indices = _indices(batch)
  size, first = len(indices), max(indices) + 1
  out = []
  for j in range(count):
    items = [(i, intake.prompts.problem(i))
             for i in range(first + j * size, first + (j + 1) * size)]
    out.append(PromptBatch([intake.codec.encode_prompt(p.prompt) for _, p in items], batch.n,
                           batch.sampling, meta=items))
  return out


class LocalWorker:
  """The one in-process worker that generates for every virtual worker, at the newest weights.

  A worker that counts its calls (`RolloutWorker.call_count` not None: the JAX sampler's noise
  stream) starts at `state.requests`, so a resumed run draws the noise the uninterrupted run would have drawn.

  generation_batch K > 1 (a JAX sampler; `state` required): a request that has no result waiting
  is generated in one `generate_requests` call together with the K - 1 requests the intake is
  expected to hand out next (`upcoming_requests`), at the same weights. Request number m (its
  `state.requests` at its start) draws the noise of call index m, as it does with K = 1, so its
  groups do not depend on which requests shared the call. A later request is served from those
  results when it starts at the same weights version with the predicted prompts; when it starts
  at newer weights (or is another request) every waiting result is discarded
  (`state.speculative_discarded` counts their rollouts) and a new call is made. The waiting
  results are part of the schedule's checkpoint (`state_dict`), so a resumed run serves what the
  uninterrupted one would have served. The measured seconds of a call go to the hooks with the
  request that made it (those served later report 0: the machine's time is counted when spent).
  """

  def __init__(self, make_worker: MakeWorker, state: Optional["SimState"] = None,
               generation_batch: int = 1):
    if generation_batch < 1:
      raise ValueError(f"generation_batch={generation_batch} must be >= 1")
    if generation_batch > 1 and state is None:
      raise ValueError("generation_batch > 1 numbers requests by the virtual clock: pass its state")
    self.make_worker = make_worker
    self.state = state
    self.generation_batch = int(generation_batch)
    self._worker: Optional[RolloutWorker] = None
    self._ahead: dict[int, _Ahead] = {}  # request number -> its groups, generated ahead

  def _at(self, weights: Weights) -> RolloutWorker:
    """The worker, made (on first use) or refreshed to hold `weights`."""
    if self._worker is None:
      self._worker = self.make_worker(0, weights)
      if self._worker.policy_version != weights.version:  # started without them (superseded)
        self._worker.load_weights(weights)
      if self.state is not None and self._worker.call_count is not None:
        self._worker.call_count = self.state.requests
      logging.info("started the rollout worker")
    elif self._worker.policy_version != weights.version:
      self._worker.load_weights(weights)
    return self._worker

  def generate(self, hooks: Hooks, batch) -> list[Group]:
    """Generates one request with the newest weights; the measured seconds go to the hooks."""
    weights = hooks.latest_weights()
    worker = self._at(weights)
    if self.generation_batch > 1:
      groups, seconds = self._generate_ahead(hooks, worker, batch, weights.version)
    else:
      t0 = time.perf_counter()
      groups = worker.generate(batch.prompts, batch.n, batch.sampling)
      seconds = time.perf_counter() - t0
    hooks.generated(groups, seconds)
    return groups

  def _generate_ahead(self, hooks: Hooks, worker: RolloutWorker, batch: PromptBatch,
                      version: int) -> tuple[list[Group], float]:
    """(groups, measured seconds) of request number `state.requests`: waiting (0 seconds), or
    generated now with the next K - 1 expected requests (the call's seconds)."""
    number = self.state.requests
    waiting = self._ahead.pop(number, None)
    if waiting is not None and waiting.serves(batch, version):
      return waiting.groups, 0.0
    if waiting is not None:
      self._ahead[number] = waiting
    self.discard()
    if not hasattr(worker, "generate_requests"):
      raise TypeError(f"scheduler.generation_batch={self.generation_batch} needs a rollout worker "
                      f"with generate_requests (the JAX sampler); {type(worker).__name__} has "
                      "none: set scheduler.generation_batch=1")
    batches = [batch] + upcoming_requests(hooks.intake, batch, self.generation_batch - 1)
    t0 = time.perf_counter()
    outputs = worker.generate_requests(
        [(b.prompts, b.n, number + j) for j, b in enumerate(batches)], batch.sampling)
    seconds = time.perf_counter() - t0
    for j in range(1, len(batches)):
      ahead = _Ahead(version, _indices(batches[j]), batch.n, batch.sampling, outputs[j])
      self._ahead[number + j] = ahead
      self.state.speculative_rows += ahead.rows
    return outputs[0], seconds

  def discard(self) -> None:
    """Drops every result generated ahead (counted in `state.speculative_discarded`)."""
    for ahead in self._ahead.values():
      self.state.speculative_discarded += ahead.rows
    self._ahead.clear()

  def state_dict(self) -> dict[str, Any]:
    """The results generated ahead, per request number (checkpointed by the schedule)."""
    return {"ahead": [a.state_dict(m) for m, a in sorted(self._ahead.items())]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`."""
    self._ahead = {int(a["request"]): _Ahead.from_state(a) for a in state["ahead"]}

  def run_jobs(self, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Runs each job on the worker at `weights`, in order (the next request reloads the newest)."""
    worker = self._at(weights)
    return [fn(worker) for fn in fns]

  def close(self) -> None:
    if self._worker is not None:
      self._worker.close()
      self._worker = None


class _LocalJobs(Schedule):
  """Jobs (engine evaluation) of a schedule with one in-process `LocalWorker` (`self.worker`)."""

  worker: LocalWorker
  job_parallelism = 1  # jobs run on the one local worker

  def run_jobs(self, hooks: Hooks, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Runs the jobs on the local worker at `weights` (no virtual time passes)."""
    del hooks
    return self.worker.run_jobs(weights, fns)

  def close(self) -> None:
    self.worker.close()


def virtual_costs(parts) -> dict[str, Any]:
  """The simulated clock's costs of a built run: `cost`, `train_device_seconds` and `state`
  (the keyword arguments the simulated and sync schedules share)."""
  c, gen = parts.config, parts.generation
  cost = GenerationCost(gen.gen_seconds_per_rollout, c.scheduler.prefill_fraction, gen.sim_state)
  return dict(cost=cost, train_device_seconds=c.scheduler.train_seconds_per_step,
              state=gen.sim_state)
