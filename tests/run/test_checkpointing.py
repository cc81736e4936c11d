"""`run.checkpointing.RunCheckpoint`: the host state's keys (those old checkpoints hold), its round
trip, an older host state without the later keys, and the schedule's state through the Schedule
contract (no `hasattr`)."""
import logging
import threading
import types

import numpy as np

from jaxreplay.infra import safety
from jaxreplay.learner.batch import Rollout
from jaxreplay.rollout.base import Weights
from jaxreplay.data import batch_reuse
from jaxreplay.run import checkpointing
from jaxreplay.run.eval_grid import EvalGrid
from jaxreplay.run.schedules import GenerationCost, SimState, SimulatedScheduler, SyncScheduler

# The keys every checkpoint since the eval grid holds (plus the intake's own, and "scheduler" /
# "lora" when they apply): resumes depend on them.
HOST_KEYS = {"buffer", "accountant", "sim", "published_version", "eval_calls", "counters", "regime",
             "reuse", "batch_reuse", "nonfinite", "eval_grid"}


class Stateful:
  """A part with `state_dict` / `load_state_dict` (the buffer, the accountant)."""

  def __init__(self, state):
    self.state = state

  def state_dict(self):
    return dict(self.state)

  def load_state_dict(self, state):
    self.state = dict(state)


class Intake(Stateful):
  snapshot_lock = threading.Lock()

  def load_state_dict(self, host):  # the intake reads its keys from the whole host state
    self.state = {k: host[k] for k in ("source", "next_group_id")}


class Metrics:
  def __init__(self, counters):
    self.saved = counters

  def counters(self):
    return dict(self.saved)

  def restore_counters(self, counters):
    self.saved = dict(counters)


def make(schedule="sync", buffer=(), cursor=0, calls=0, counters=None, reuse_plan=None):
  sim = SimState()
  cost = GenerationCost(1.0, 0.0, sim)
  make_worker = lambda i, w: None
  scheduler = (SyncScheduler(make_worker, 1, 1, 2, cost, 1.0, sim) if schedule == "sync" else
               SimulatedScheduler(make_worker, 1, 1, cost, 1.0, sim))
  parts = types.SimpleNamespace(
      config=types.SimpleNamespace(export_hf_every=0),
      data=types.SimpleNamespace(buffer=Stateful({"rollouts": list(buffer)}),
                                 intake=Intake({"source": cursor, "next_group_id": cursor}),
                                 reuse=None,
                                 batch_reuse=reuse_plan or batch_reuse.BatchReuse(1)),
      telemetry=types.SimpleNamespace(accountant=Stateful({"seconds": 1.0}), regime=None,
                                      metrics=Metrics(counters or {})),
      generation=types.SimpleNamespace(sim_state=sim), learner=types.SimpleNamespace(lora=None))
  training = types.SimpleNamespace(weights=Weights(7), step=7)
  evaluator = types.SimpleNamespace(calls=calls, grid=EvalGrid((1.0, 2.0)))
  guard = safety.NonFiniteGuard(3)
  return checkpointing.RunCheckpoint(parts, training, evaluator, guard, scheduler), parts


def test_host_state_keys_round_trip_and_the_schedules_state():
  saved, parts = make(buffer=[1, 2], cursor=5, calls=12, counters={"rollouts": 9})
  saved.guard.consecutive, saved.guard.total = 1, 2
  saved.evaluator.grid.next = 1
  parts.generation.sim_state.clock = 3.5
  host = saved.host_state()
  assert set(host) == HOST_KEYS | {"source", "next_group_id"}  # sync: no schedule state
  assert host["published_version"] == 7 and host["eval_calls"] == 12

  fresh, fresh_parts = make()
  fresh.restore(host)
  assert fresh_parts.data.buffer.state == {"rollouts": [1, 2]}
  assert fresh_parts.data.intake.state == {"source": 5, "next_group_id": 5}
  assert fresh_parts.generation.sim_state.clock == 3.5 and fresh.evaluator.calls == 12
  assert fresh_parts.telemetry.metrics.saved == {"rollouts": 9}
  assert (fresh.guard.consecutive, fresh.guard.total, fresh.evaluator.grid.next) == (1, 2, 1)

  # The simulated schedule checkpoints its in-flight requests; a resume loads them back.
  simulated, _ = make("simulated")
  host = simulated.host_state()
  assert host["scheduler"] == {"workers": [None]}
  resumed, _ = make("simulated")
  resumed.restore(host)
  assert resumed.scheduler._restored == [None]  # pylint: disable=protected-access
  assert host["batch_reuse"] is None  # one update per batch: nothing held

  # Several updates per fresh batch (ppo_epochs): the position in the held batch is restored.
  plan = batch_reuse.BatchReuse(2, epochs=2)
  plan.begin([Rollout(np.array([1], np.int32), np.array([i], np.int32),
                      np.array([-0.5], np.float32), 1.0, 0.5, 0, 0) for i in range(2)])
  plan.record({}, 0)
  ckpt, _ = make(reuse_plan=plan)
  again = batch_reuse.BatchReuse(2, epochs=2)
  restored, _ = make(reuse_plan=again)
  restored.restore(ckpt.host_state())
  assert (again.index, again.batches, len(again.held)) == (1, 1, 2)

def test_an_older_host_state_resumes(caplog):
  """A checkpoint from before the later keys: the optional ones are left at their values."""
  host = {"buffer": {"rollouts": [3]}, "source": 2, "next_group_id": 4,
          "accountant": {"seconds": 5.0}, "sim": {"clock": 1.0, "requests": 3},
          "published_version": 2}
  ckpt, parts = make(calls=6)
  ckpt.restore(host)
  assert parts.data.buffer.state == {"rollouts": [3]} and parts.generation.sim_state.requests == 3
  assert ckpt.evaluator.calls == 6 and ckpt.guard.total == 0 and ckpt.evaluator.grid.next == 0
  # A simulated run's checkpoint resumed under the sync schedule: its requests are generated again.
  with caplog.at_level(logging.INFO):
    ckpt.restore({**host, "scheduler": {"workers": [None]}})
  assert "generated again under scheduler.kind='sync'" in caplog.text
