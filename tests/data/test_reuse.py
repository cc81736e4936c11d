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


def test_optimal_reuse_maximises_progress_per_compute():
  """rho* = sqrt(mu ESS s) against a numeric argmax of the progress-per-compute model it is
  derived from, 1 / ((1 + rho / (ESS s)) (1 + mu / rho)), on a fine grid."""
  rhos = np.exp(np.linspace(math.log(0.01), math.log(100.0), 200001))
  for s, mu, ess in [(2.3, 6.84, 1.0), (0.15, 6.84, 1.0), (1.0, 5.28, 0.6), (10.0, 1.0, 0.9)]:
    progress = 1.0 / ((1.0 + rhos / (ess * s)) * (1.0 + mu / rhos))
    assert reuse.optimal_reuse(s, mu, ess) == pytest.approx(rhos[np.argmax(progress)], rel=1e-4)
  assert reuse.optimal_reuse(2.3, 6.84) == pytest.approx(math.sqrt(15.732))   # ~3.97
  assert reuse.optimal_reuse(4.0, 4.0, float("nan")) == pytest.approx(4.0)   # no ESS: 1
  assert reuse.optimal_reuse(float("nan"), 6.84) == 0.0 and reuse.optimal_reuse(-1, 6.84) == 0.0


def test_staleness_bound_keeps_the_mean_behaviour_kl_under_kl_max():
  """A uniform draw from N at ratio rho is N rho / (2 B) updates old on average: at the bound the
  mean age times the update KL is kl_max."""
  b, n, kl_max, u = 512, 2048, 0.02, 0.004
  rho = reuse.staleness_bound(u, kl_max, b, n)
  assert rho == pytest.approx(2.0 * 512 * 0.02 / (2048 * 0.004))            # 2.5
  assert (n * rho / (2 * b)) * u == pytest.approx(kl_max)
  assert reuse.staleness_bound(float("nan"), kl_max, b, n) == math.inf
  assert reuse.staleness_bound(0.0, kl_max, b, n) == math.inf


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


def test_adaptive_decisions_follow_the_derived_rule_and_the_guards():
  ctl = reuse.ReuseController(_settings(mu=4.0), 64, 8, buffer_size=256)
  out = ctl.decide({"diag/batch_over_noise_scale": 0.5}, step=0)  # the first sets rho directly
  assert out["controller/reuse_target"] == pytest.approx(math.sqrt(2.0))   # sqrt(4 x 0.5)
  assert out["controller/optimal"] == pytest.approx(math.sqrt(2.0))
  assert "controller/staleness_bound" not in out  # no update KL measured
  ctl = reuse.ReuseController(_settings(mu=4.0), 64, 8, buffer_size=256)
  ctl.decide({"diag/batch_over_noise_scale": 1.0, "diag/is_ess": 0.5625}, step=0)
  assert ctl.rho == pytest.approx(1.5)                                      # sqrt(4 x 0.5625)
  ctl.rho = 2.0
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/behaviour_kl_k3": 0.001,
                    "diag/is_ess": 1.0, "diag/update_kl": 1e-4}, step=10)
  assert out["controller/optimal"] == pytest.approx(4.0)
  assert out["controller/staleness_bound"] == pytest.approx(2 * 64 * 0.02 / (256 * 1e-4))  # 100
  assert out["controller/reuse_target"] == pytest.approx(3.0)  # wants 4, moves at most 1.5x
  assert out["controller/guards_fired"] == 0 and "batch/noise scale 4" in out["controller/reason"]
  # The update KL's bound: 2 B kl_max / (N u) = 2 x 64 x 0.02 / (256 x 0.004) = 2.5 < rho* = 4.
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/update_kl": 0.004}, step=15)
  assert out["controller/reuse_target"] == pytest.approx(2.5)
  assert "bounds rho at 2.5" in out["controller/reason"]
  ctl.rho = 3.0
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/behaviour_kl_k3": 0.05}, step=20)
  assert out["controller/reuse_target"] == pytest.approx(2.0)  # stale: cut by a third
  assert out["controller/guards_fired"] == 1 and "behaviour KL" in out["controller/reason"]
  assert out["controller/newest_unused"] == 0.0
  # Off by default: ESS and update-KL thresholds fire only when set.
  out = ctl.decide({"diag/batch_over_noise_scale": 4.0, "diag/is_ess": 0.1}, step=25)
  assert out["controller/guards_fired"] == 0
  strict = reuse.ReuseController(_settings(mu=4.0, ess_min=0.8, update_kl_max=0.01), 64, 8)
  strict.rho = 3.0
  out = strict.decide({"diag/batch_over_noise_scale": 4.0, "diag/is_ess": 1.0,
                       "diag/update_kl": 0.02}, step=5)
  assert out["controller/guards_fired"] == 1 and "update KL > 0.01" in out["controller/reason"]
  for _ in range(5):
    out = ctl.decide({"diag/batch_over_noise_scale": 0.05}, step=30)   # sqrt(4 x 0.05) < 1
  assert out["controller/reuse_target"] == 1.0  # noise-dominated: on-policy-like reuse
  assert out["controller/newest_unused"] == 1.0
  state = ctl.state_dict()
  other = reuse.ReuseController(_settings(), 64, 8)
  other.load_state_dict(state)
  assert (other.rho, other.required, other.decisions) == (ctl.rho, ctl.required, 10)
  other.load_state_dict({"rho": 2.0, "required": 64.0})  # a checkpoint from before `decisions`
  assert other.decisions == 1


def test_settings_reject_what_the_rule_cannot_use():
  with pytest.raises(ValueError, match="scheduler.mu"):
    _settings(mu=0.0)
  with pytest.raises(ValueError, match="reuse_ess_min"):
    _settings(ess_min=1.5)
  with pytest.raises(ValueError, match="reuse_kl_max"):
    _settings(kl_max=0.0)


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
