"""Who runs when: the simulated (virtual-time) and the asynchronous (real threads) schedules.

Both drive the same `Hooks` (implemented by `jaxreplay.run.pipeline.Pipeline`) and the same request
intake (`jaxreplay.data.experience.Intake`), so the replay run and the on-policy baseline differ only by
the buffer settings, never by a second code path. `pipeline.run` picks one of the two.

Virtual costs (`GenerationCost`). A request's generation takes device-seconds that follow what it
generated: a fixed part per rollout (prefill) plus a part per generated token (decode), calibrated
so that B rollouts of the reference completion length cost mu gradient steps (the paper's mu, the
generation / training cost per update). Longer completions cost more, as on real hardware, so
workers desynchronise by themselves.

Simulated schedule (`SimulatedScheduler`). W workers and T trainer devices in virtual time:
  - a worker request runs for its generation cost on one worker device; the worker samples with the
    newest published weights at the moment the request starts, and its rollouts enter the buffer
    when the request ends;
  - a gradient step takes `train_device_seconds / T` virtual seconds; its weights are published
    (every `refresh_every` steps) when the step ends.
Events at equal times are processed trainer first, then workers by index; work is then started
workers first (so they sample with the weights just published), then the trainer. The real
computation runs in that order on this machine (one local worker generates for every virtual one),
so the buffer sees exactly the staleness pattern of the real pipeline on the modelled hardware, and
the same seed gives the same run bit for bit, whatever this machine's speed. With
`scheduler.generation_batch` K > 1 the local worker generates a request together with the K - 1
requests expected next, at the same weights (`LocalWorker`): request m still draws the noise of
call m, and is served from that call only if it starts at the same weights version, so the
requests, their tokens and the virtual clock are those of K = 1 (bit for bit where the sampler's
batches keep their shape, i.e. the same prompt bucket; else up to its float rounding).

Synchronous schedule (`SyncScheduler`): the theory's setting (PAPER.md, Section 4). Each step
generates R = `rollouts_per_step` rollouts with the current policy into the buffer (a FIFO of N),
then samples B and takes one gradient step: N/R and B/R are exact knobs, and N = B = R is on-policy.

Asynchronous schedule (`AsyncScheduler`). A `WorkerPool` of W real workers (threads driving
in-process JAX samplers or vLLM engine processes) fills the buffer while this thread trains as soon
as a batch can be served, and hands each new `Weights` handle to the pool. With several trainer
processes (jax.distributed), process 0 runs it and owns the one buffer and the workers; every step
it sends the batch's rollouts to the others (`step_channel.StepChannel`), which run
`FollowerScheduler`: they take the same steps on the same batch and generate nothing.

Jobs on the workers (`run_jobs(hooks, weights, fns)`, every schedule): the pipeline evaluates on the
rollout engines through it (config.eval.backend="engines"). The simulated and sync schedules run
the jobs on their local worker, brought to `weights` (the next request reloads the newest weights);
the asynchronous one queues them on its pool (`WorkerPool.run_jobs`: free runners take them between
two requests while the others keep generating) and waits. `job_parallelism` is how many workers may
run jobs at once; `close()` releases the workers (also when `run` never started).
"""
from __future__ import annotations

import importlib

from jaxreplay.config import schedule_table
from jaxreplay.run.schedules.async_ import AsyncScheduler, FollowerScheduler, LeaderStopped
from jaxreplay.run.schedules.base import (GenerationCost, Hooks, Job, LocalWorker, MakeWorker,
                                          Schedule, SimState, _LocalJobs, decode_group,
                                          encode_group, virtual_costs)
from jaxreplay.run.schedules.simulated import SimulatedScheduler
from jaxreplay.run.schedules.sync import SyncScheduler

def schedule_class(kind: str) -> type[Schedule]:
  """The schedule class of `config.scheduler.kind` (ask it what the schedule is): its record's
  `cls` in the table `config.schedule_table.SCHEDULES` (an import path, imported now, or the
  class)."""
  try:
    entry = schedule_table.SCHEDULES[kind].cls
  except KeyError:
    raise ValueError(f"scheduler.kind={kind!r}: expected one of "
                     f"{tuple(schedule_table.SCHEDULES)}") from None
  if isinstance(entry, str):
    module, _, name = entry.partition(":")
    entry = getattr(importlib.import_module(module), name)
  if not (isinstance(entry, type) and issubclass(entry, Schedule)) or entry.kind != kind:
    raise TypeError(f"schedule_table.SCHEDULES[{kind!r}].cls is {entry!r}: expected a Schedule "
                    f"subclass whose kind is {kind!r}")
  return entry


__all__ = ["AsyncScheduler", "FollowerScheduler", "GenerationCost", "Hooks", "Job", "LeaderStopped",
           "LocalWorker", "MakeWorker", "Schedule", "SimState", "SimulatedScheduler",
           "SyncScheduler", "decode_group", "encode_group", "schedule_class", "virtual_costs"]
