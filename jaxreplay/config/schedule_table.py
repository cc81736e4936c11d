"""The schedule table: config `scheduler.kind` -> its `Schedule` class and what validation asks.

The config layer validates `scheduler.kind` (and a schedule's own keys) from these records without
importing the run layer; `run.schedules.schedule_class(kind)` imports the class on first use (a
record's `cls` may also be the class itself). A new schedule is its module in
`jaxreplay/run/schedules/` (a `Schedule` subclass whose `kind` is its name here) + one row below.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ScheduleRecord:
  """cls: the `Schedule` class, or its "module:Class" import path.
  rollouts_per_step: it generates scheduler.rollouts_per_step rollouts per step (R), so
    validation checks R against one request and the on-policy queue.
  batched_generation: its requests run in virtual time on one in-process worker, which may
    generate the next requests together (scheduler.generation_batch != 1).
  partial_rollouts: its workers run beside the trainer, so a weight refresh may reach a request
    in flight and continue it (rollout.partial="continue")."""
  cls: Any
  rollouts_per_step: bool = False
  batched_generation: bool = False
  partial_rollouts: bool = False


SCHEDULES: dict[str, ScheduleRecord] = {
    "simulated": ScheduleRecord("jaxreplay.run.schedules.simulated:SimulatedScheduler",
                                batched_generation=True),
    "sync": ScheduleRecord("jaxreplay.run.schedules.sync:SyncScheduler", rollouts_per_step=True),
    "async": ScheduleRecord("jaxreplay.run.schedules.async_:AsyncScheduler", partial_rollouts=True),
}
