"""`schedules.base` and the package's table: the virtual generation cost, the local worker's jobs,
and the class-level facts every schedule answers (over fake hooks)."""
import numpy as np
import pytest

from jaxreplay.rollout.base import Completion, Group, Weights
from jaxreplay.run.schedules import (AsyncScheduler, GenerationCost, SimState, SimulatedScheduler,
                                  SyncScheduler)
from tests.helpers.schedule_fakes import FakeHooks, FakeWorker, simulated


def test_generation_cost_follows_tokens_and_calibrates_on_the_first_request():
  state = SimState()
  cost = GenerationCost(2.0, 0.25, state)
  def groups(*lengths):
    return [Group(np.ones(3, np.int32), [Completion(np.zeros(k, np.int32), np.zeros(k, np.float32),
                                                    "stop") for k in lengths], 0)]
  assert cost(groups(4, 6)) == pytest.approx(4.0)  # the first request sets L = 5: 2 x g
  assert state.reference_tokens == 5.0
  # g * (f * n + (1 - f) * tokens / L) = 2 * (0.25 * 2 + 0.75 * 20 / 5)
  assert cost(groups(10, 10)) == pytest.approx(7.0)
  assert cost(groups(5)) == pytest.approx(2.0)  # a reference-length rollout costs g
  with pytest.raises(ValueError, match="prefill_fraction"):
    GenerationCost(1.0, 1.0, state)


def _trajectory(turns, observation):
  """A multi-turn completion: `turns` policy turns of 4 tokens, `observation` tokens between."""
  from jaxreplay.rollout import multiturn  # pylint: disable=g-import-not-at-top
  mask = ([0.0] * observation + [1.0] * 4) * turns
  mask = np.asarray(mask[observation:], np.float32)
  starts = np.flatnonzero(np.diff(np.r_[0.0, mask]) > 0).astype(np.int32)
  return Completion(np.arange(len(mask), dtype=np.int32) + 3, np.where(mask > 0, -0.5, 0.0)
                    .astype(np.float32), "stop", mask=mask, turn_starts=starts,
                    episode=multiturn.EpisodeInfo(1.0, "stop", turns, tool_calls=turns - 1))


def test_generation_cost_of_multi_turn_requests():
  """A trajectory costs one prefill per policy turn and only the tokens the policy generated (its
  observations are prefilled, not generated)."""
  state = SimState(reference_tokens=4.0)
  cost = GenerationCost(2.0, 0.25, state)
  three = Group(np.ones(3, np.int32), [_trajectory(3, 5)], 0)   # 12 policy tokens, 3 turns
  assert three.completions[0].policy_tokens == 12 and three.completions[0].num_turns == 3
  # 2 * (0.25 * 3 + 0.75 * 12 / 4) = 6.0; the 10 observation tokens cost nothing extra
  assert cost([three]) == pytest.approx(6.0)
  one = Group(np.ones(3, np.int32), [Completion(np.zeros(12, np.int32),
                                                np.zeros(12, np.float32), "stop")], 0)
  assert cost([one]) == pytest.approx(2.0 * (0.25 + 0.75 * 3))  # one prefill, same tokens


def test_multi_turn_groups_survive_the_checkpoint_encoding():
  from jaxreplay.run.schedules import base  # pylint: disable=g-import-not-at-top
  group = Group(np.ones(3, np.int32), [_trajectory(2, 3), _trajectory(3, 2)], 4, prompt_index=1)
  back = base.decode_group(base.encode_group(group))
  assert back.policy_version == 4 and back.prompt_index == 1
  for a, b in zip(back.completions, group.completions):
    for field in ("tokens", "logprobs", "mask", "turn_starts"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.episode == b.episode and a.finish_reason == b.finish_reason


def test_local_worker_runs_jobs_at_the_given_weights_then_rollouts_at_the_newest():
  log = []
  hooks = FakeHooks(batch=2, total=2)
  state = SimState(reference_tokens=2.0)
  sched = simulated(lambda i, w: FakeWorker(w, log), 1, 1, state=state)
  assert sched.job_parallelism == 1
  # Before run (the step-0 evaluation): the worker is made at the job's weights.
  out = sched.run_jobs(hooks, Weights(7), [lambda w: ("a", w.policy_version),
                                          lambda w: ("b", w.policy_version)])
  assert out == [("a", 7), ("b", 7)] and log == [("make", 7)]
  sched.run(hooks)
  assert log[1] == ("load", 0)  # the first request reloads the newest published weights
  assert set(hooks.intake.delivered_versions) <= {0, 1, 2} and hooks.step == 2
  sched.close()  # idempotent after run


def test_schedules_answer_what_they_are():
  """Callers ask the schedule's class (by config.scheduler.kind), never the kind string."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import schedules  # pylint: disable=g-import-not-at-top
  from jaxreplay.run.schedules import FollowerScheduler  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import schedule_table  # pylint: disable=g-import-not-at-top
  assert set(schedule_table.SCHEDULES) == {"simulated", "sync", "async"}
  sim, sync, asyn = (schedules.schedule_class(k) for k in ("simulated", "sync", "async"))
  assert (sim, sync, asyn) == (SimulatedScheduler, SyncScheduler, AsyncScheduler)
  assert sim.virtual_time and sync.virtual_time and not asyn.virtual_time
  assert sim.mismatch_at_generation and sync.mismatch_at_generation
  assert not asyn.mismatch_at_generation
  assert asyn.leader_owns_workers and FollowerScheduler.leader_owns_workers
  assert not sim.leader_owns_workers and not sync.leader_owns_workers
  c = ml_collections.ConfigDict({
      "rollout": {"num_workers": 5}, "trainer": {"num_devices": 3},
      "buffer": {"on_policy": False, "batch_size": 60, "reuse_control": "off"},
      "scheduler": {"mu": 5.28, "rollouts_per_step": 60}})
  assert asyn.num_actors(c) == 5 and sim.num_actors(c) == 1 and sync.num_actors(c) == 1
  assert asyn.gamma(c, SimState()) is None
  assert sim.gamma(c, SimState()) == pytest.approx(0.4246, abs=1e-4)  # (1 + 5/3) / (1 + 5.28)
  assert sync.gamma(c, SimState()) == pytest.approx(1.0)  # N = B = R
  c.buffer.on_policy = True
  assert sim.gamma(c, SimState()) == 1.0
  with pytest.raises(ValueError, match="expected one of"):
    schedules.schedule_class("nope")
