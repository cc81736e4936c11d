"""The reuse controller: its gates pace a run to the target replay ratio, its adaptive rule, its
host state; the never-used fraction of the buffer."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxreplay.data.buffer import ReplayBuffer
from jaxreplay.learner.batch import Rollout
from jaxreplay.data import reuse
from tests.helpers import tiny_runs
from tests.helpers.paths import REPO


def _settings(**kw):
  return reuse.ReuseSettings(**{"control": "adaptive", "target": 2.0, **kw})


def test_signal_target_is_log_linear_between_the_thresholds():
  assert reuse.signal_target(0.1, 1.0, 4.0) == 1.0
  assert reuse.signal_target(float("nan"), 1.0, 4.0) == 1.0
  assert reuse.signal_target(5.0, 1.0, 4.0) == 4.0
  mid = math.sqrt(reuse.SIGNAL_LOW * reuse.SIGNAL_HIGH)  # halfway on the log scale
  assert reuse.signal_target(mid, 1.0, 4.0) == pytest.approx(2.5)


@pytest.mark.parametrize("rho, workers", [(3.0, 1), (1.25, 6), (2.0, 3)])
def test_gates_pace_the_replay_ratio(rho, workers):
  """An event loop with a fast or slow generator: the buffer's replay ratio ends at rho."""
  b, request = 32, 8
  ctl = reuse.ReuseController(reuse.ReuseSettings(control="fixed", target=rho), b, request)
  buf = ReplayBuffer(128, seed=0)
  in_flight, uid = 0, 0
  for _ in range(3000):
    for _ in range(workers):  # each tick: up to `workers` requests start and land
      if ctl.may_start_request(buf.total_added, in_flight):
        in_flight += request
    buf.add([Rollout(np.array([1]), np.array([2]), np.array([-1.0]), 0.0, 0.0, 0, uid + i)
             for i in range(in_flight)])
    uid, in_flight = uid + in_flight, 0
    if ctl.may_train(buf.total_added) and len(buf) >= b:
      buf.sample(b)
      ctl.stepped()
  m = buf.metrics()
  assert m["buffer/replay_ratio"] == pytest.approx(rho, rel=0.03)
  # Throttled: never more than one update's rollouts and one request ahead of the trainer.
  assert buf.total_added <= ctl.required + b / rho + request


def test_adaptive_decisions_follow_the_signal_and_the_guards():
  ctl = reuse.ReuseController(_settings(), 64, 8)
  out = ctl.decide({"diag/batch_over_noise_scale": 0.5}, step=0)  # the first sets rho directly
  assert out["controller/reuse_target"] == pytest.approx(reuse.signal_target(0.5, 1.0, 4.0))
  ctl = reuse.ReuseController(_settings(), 64, 8)
  ctl.decide({"diag/batch_over_noise_scale": 1.0}, step=0)   # rho 3 (log-linear: 2 / 3 of the way)
  assert ctl.rho == pytest.approx(3.0)
  ctl.rho = 2.0
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/behaviour_kl_k3": 0.001,
                    "diag/is_ess": 0.99, "diag/update_kl": 1e-4}, step=10)
  assert out["controller/reuse_target"] == pytest.approx(3.0)  # wants 4, moves at most 1.5x
  assert out["controller/guards_fired"] == 0 and "batch/noise scale 4" in out["controller/reason"]
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/behaviour_kl_k3": 0.05}, step=20)
  assert out["controller/reuse_target"] == pytest.approx(2.0)  # stale: cut by a third
  assert out["controller/guards_fired"] == 1 and "behaviour KL" in out["controller/reason"]
  assert out["controller/newest_unused"] == 0.0
  for _ in range(5):
    out = ctl.decide({"diag/batch_over_noise_scale": 0.05}, step=30)
  assert out["controller/reuse_target"] == 1.0  # noise-dominated: on-policy-like reuse
  assert out["controller/newest_unused"] == 1.0
  state = ctl.state_dict()
  other = reuse.ReuseController(_settings(), 64, 8)
  other.load_state_dict(state)
  assert (other.rho, other.required, other.decisions) == (ctl.rho, ctl.required, 8)
  other.load_state_dict({"rho": 2.0, "required": 64.0})  # a checkpoint from before `decisions`
  assert other.decisions == 1


def _rollouts(uids, version=0):
  return [Rollout(np.array([1]), np.array([2]), np.array([-1.0]), 0.0, 0.0, version, u)
          for u in uids]


def test_controller_at_rho_one_trains_on_the_newest_unused_like_the_lifo_queue():
  """At rho = 1 the paced buffer's batches are the on-policy LIFO queue's batches (same uids, in
  the same order) while it keeps everything; above 1 it samples uniformly again."""
  b, request = 4, 2
  buf = ReplayBuffer(16, seed=0)
  queue = ReplayBuffer(16, seed=0, consume=True, consume_order="lifo")
  ctl = reuse.ReuseController(_settings(), b, request, buffer=buf)
  assert not buf.newest_unused                       # starts at reuse_target 2
  ctl.decide({"diag/batch_over_noise_scale": 0.01}, step=0)
  assert ctl.rho == 1.0 and buf.newest_unused        # first measurement: noise-dominated
  uid = 0
  for step in range(12):
    while ctl.may_start_request(buf.total_added, 0):
      buf.add(_rollouts(range(uid, uid + request), step))
      queue.add(_rollouts(range(uid, uid + request), step))
      uid += request
    assert ctl.may_train(buf.total_added)
    got = [r.uid for r in buf.sample(b, current_version=step)]
    assert got == [r.uid for r in queue.sample(b)]
    assert buf.last_batch_stats["use_count_max"] == 1
    ctl.stepped()
  assert len(buf) == 16                              # nothing removed, unlike the queue
  ctl.rho = 1.2
  ctl.decide({"diag/batch_over_noise_scale": 2.0}, step=12)
  assert ctl.rho == pytest.approx(1.8) and not buf.newest_unused


def test_newest_unused_falls_back_to_the_configured_draw():
  buf = ReplayBuffer(8, seed=0)
  buf.add(_rollouts(range(6)))
  buf.set_newest_unused(True)
  assert [r.uid for r in buf.sample(3)] == [5, 4, 3]
  assert [r.uid for r in buf.sample(3)] == [2, 1, 0]
  ref = ReplayBuffer(8, seed=0)
  ref.add(_rollouts(range(6)))
  # none unused: the configured uniform draw, whose generator the newest-unused batches left alone
  assert [r.uid for r in buf.sample(3)] == [r.uid for r in ref.sample(3)]


def test_off_and_fixed_do_not_decide():
  off = reuse.ReuseController(reuse.ReuseSettings(), 64, 8)
  assert not off.active and off.may_start_request(10 ** 9, 10 ** 9) and off.may_train(0)
  assert off.decide({"diag/batch_over_noise_scale": 9.0}, 1) == {}
  fixed = reuse.ReuseController(reuse.ReuseSettings(control="fixed", target=3.0), 64, 8)
  assert fixed.decide({"diag/batch_over_noise_scale": 9.0}, 1) == {"controller/reuse_target": 3.0}


def test_settings_errors():
  with pytest.raises(ValueError, match="reuse_control='x'"):
    reuse.ReuseSettings(control="x")
  with pytest.raises(ValueError, match="reuse_target=8"):
    reuse.ReuseSettings(control="fixed", target=8.0)
  with pytest.raises(ValueError, match="reuse_min"):
    reuse.ReuseSettings(reuse_min=0.5)


def test_never_used_fraction():
  buf = ReplayBuffer(4, seed=0)
  buf.add([Rollout(np.array([1]), np.array([2]), np.array([-1.0]), 0.0, 0.0, 0, i)
           for i in range(4)])
  buf.sample(2)
  buf.add([Rollout(np.array([1]), np.array([2]), np.array([-1.0]), 0.0, 0.0, 0, 4 + i)
           for i in range(4)])  # evicts the 4 first: 2 of them never sampled
  m = buf.metrics()
  assert m["buffer/evicted_unused"] == 2.0
  assert m["buffer/never_used_fraction"] == pytest.approx((2 + 4) / 8)
  restored = ReplayBuffer(4, seed=0)
  restored.load_state_dict(buf.state_dict())
  assert restored.metrics()["buffer/evicted_unused"] == 2.0


@pytest.mark.slow
def test_fixed_reuse_run_reaches_its_target_and_adaptive_logs_its_decisions(tmp_path):
  """The tiny default under the simulated schedule: paced to 1.5 uses per rollout (below the
  hardware's natural ratio: the trainer waits), its gamma the spent compute; adaptive decides."""
  def run(name, *flags):
    wd = tmp_path / name
    subprocess.run([sys.executable, "-m", "jaxreplay.launch", "--config=configs/tiny.py",
                    f"--workdir={wd}", "--config.rollout.backend=jax", "--config.total_steps=20",
                    "--config.eval.every=0", "--config.eval.num_problems=16",
                    "--config.checkpoint.every=0", *flags], cwd=REPO, check=True, timeout=600,
                   capture_output=True, env=tiny_runs.ENV)
    return [json.loads(l) for l in open(wd / "metrics.jsonl")]
  rows = run("fixed", "--config.buffer.reuse_control=fixed", "--config.buffer.reuse_target=1.5")
  last = rows[-1]
  assert last["buffer/replay_ratio"] == pytest.approx(1.5, rel=0.1)
  assert last["controller/reuse_target"] == 1.5
  mu = last["sim/mu"]
  assert last["compute/gamma"] == pytest.approx((1 + mu / last["buffer/replay_ratio"]) / (1 + mu),
                                                rel=0.1)
  rows = run("adaptive", "--config.buffer.reuse_control=adaptive",
             "--config.log.diagnostics_every=5")
  decisions = [r for r in rows if "controller/reason" in r]
  assert len(decisions) == 4 and all("batch/noise scale" in r["controller/reason"]
                                     for r in decisions)
