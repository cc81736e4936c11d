"""Tests of rollout workers as Ray actors (rollout.placement="ray", `jaxreplay.rollout.ray.group`)
on a local Ray instance: JAX-sampler actors generate exactly what an in-process sampler does (also
after object-store weight refreshes, whose versions they tag), a vLLM actor's log-probs are the JAX
model's, a SIGKILLed actor is restarted by Ray under a running `WorkerPool` (its request dropped,
later deliveries at the right version) until its restarts run out, whole runs (async with two
actors; simulated, bit for bit the local run), and bad settings fail naming the fix."""
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxreplay.config import validation
from jaxreplay.run import build
from jaxreplay.config import defaults
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout import backends
from jaxreplay.models import hf_io
from jaxreplay.rollout.base import SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.rollout.base import PromptBatch
from jaxreplay.rollout.pool import WorkerPool
from jaxreplay.rollout.base import StaleWeights
from tests.helpers import tiny_runs
from tests.helpers.deps import require

CFG = presets.tiny()
PROMPTS = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10, 11, 12, 13], np.int32),
           np.array([1, 40], np.int32)]
SAMPLING = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
REPO = tiny_runs.REPO


@pytest.fixture(scope="module")
def ray_cluster():
  """One local Ray instance for the module (3 logical CPUs; the groups reserve their bundles)."""
  ray = require("ray")
  start = time.perf_counter()
  if not ray.is_initialized():  # "local": a new instance, even where `ray start` made a cluster
    ray.init(address="local", num_cpus=3, include_dashboard=False)
  print(f"\nray.init: {time.perf_counter() - start:.1f} s")
  yield ray
  ray.shutdown()


@pytest.fixture(scope="module")
def params():
  return [transformer.init_params(CFG, jax.random.key(s)) for s in (0, 1, 2)]


def jax_spec(**kwargs):
  from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
  return ray_group.WorkerSpec("jax", CFG, max_len=64, sampler_batch_size=16,
                              eos_token_ids=(CFG.eos_token_id,), seed=7, **kwargs)


def assert_same_groups(got, want, version):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.policy_version == version
    np.testing.assert_array_equal(g.prompt_tokens, w.prompt_tokens)
    assert len(g.completions) == len(w.completions)
    for a, b in zip(g.completions, w.completions):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_array_equal(a.logprobs, b.logprobs)  # exact, not close
      assert a.finish_reason == b.finish_reason


def test_jax_actor_matches_the_in_process_sampler_through_object_store_refreshes(ray_cluster,
                                                                                  params):
  from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
  spec = jax_spec()
  with ray_group.RayRolloutGroup(spec, 1) as group, \
      ray_group.ObjectStorePublisher(CFG, "params", None, keep=2) as pub:
    assert group.pg is not None and group.bundle == {"CPU": 1.0} and not group.owns_ray
    w0 = pub.publish(params[0], 0)
    assert w0.object_ref is w0.ready and w0.params is None  # the handle carries no arrays
    start = time.perf_counter()
    worker = group.make_worker(0, w0)
    print(f"\nJAX actor start + first load: {time.perf_counter() - start:.1f} s; publish stall "
          f"{pub.latest.stall_s * 1e3:.1f} ms, put {pub.latest.write_s * 1e3:.1f} ms, load "
          f"{worker.last_load_phases}")
    assert worker.policy_version == 0 and worker.pid != os.getpid()
    assert worker.info["backend"] == "jax" and worker.info["node_id"]
    local = JaxSampler(CFG, params[0], 64, batch_size=16, eos_token_ids=(CFG.eos_token_id,),
                       seed=spec.seed_of(0))
    assert_same_groups(worker.generate(PROMPTS, 4, SAMPLING), local.generate(PROMPTS, 4, SAMPLING), 0)
    assert worker.call_count == local.call_count == 1

    # A refresh through the object store: the actor's groups are the in-process sampler's at the
    # new params (the call counters go on), tagged with the new version.
    w1 = pub.publish(params[1], 1)
    phases = worker.load_weights(w1)
    assert worker.policy_version == 1 and phases["total_s"] >= phases["actor_s"] > 0
    local.load_weights(Weights(1, params=params[1], cfg=CFG))
    assert_same_groups(worker.generate(PROMPTS, 2, SAMPLING), local.generate(PROMPTS, 2, SAMPLING), 1)
    worker.call_count = 0  # the counter a resumed run sets (LocalWorker)
    local.call_count = 0
    assert_same_groups(worker.generate(PROMPTS, 2, SAMPLING), local.generate(PROMPTS, 2, SAMPLING), 1)

    # keep=2: version 0's object is dropped once version 2 is stored; loading it is refused.
    w2 = pub.publish(params[2], 2)
    w2.wait()
    assert w0.object_ref.result().ref is None and w1.object_ref.result().ref is not None
    with pytest.raises(StaleWeights, match="version 0 was dropped"):
      worker.load_weights(w0)
    assert worker.policy_version == 1
    worker.load_weights(w2)
    assert {g.policy_version for g in worker.generate(PROMPTS, 1, SAMPLING)} == {2}
    with pytest.raises(ValueError, match="no object-store copy.*RolloutBackend.publish"):
      worker.load_weights(Weights(3, params=params[0]))
    with pytest.raises(ValueError, match="versions must increase"):
      pub.publish(params[0], 2)
    # A second proxy of the same live actor holds its version (the pool's replacement path).
    again = group.make_worker(0, None)
    assert again.pid == worker.pid and again.policy_version == 2


def test_object_store_hf_payload_is_the_hf_state_dict_in_the_engine_dtype(ray_cluster, params):
  from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
  ray = ray_cluster
  with ray_group.ObjectStorePublisher(CFG, "hf", "bfloat16", keep=1) as pub:
    stored = ray_group.stored_weights(pub.publish(params[0], 5))
    payload = ray.get(stored.ref)
  reference = hf_io.to_hf_state_dict(CFG, jax.device_get(params[0]))
  assert list(payload) == list(reference)  # HF names, HF order
  for name, ref in reference.items():
    assert payload[name].dtype == np.dtype(ml_dtypes.bfloat16), name
    np.testing.assert_array_equal(payload[name], ref.astype(ml_dtypes.bfloat16), err_msg=name)
  assert stored.nbytes == sum(x.size for x in reference.values()) * 2


def sigkill(pid):
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass  # the call ended first: the test then fails on what it checks


class KillDuringSlowCalls:
  """A `RayWorker` whose `generate` with the `slow` settings SIGKILLs its actor 0.2 s into the
  call (that call compiles a new output bucket and runs 12 batches x 50 steps: seconds)."""

  def __init__(self, worker, slow, killed):
    self._worker, self._slow, self._killed = worker, slow, killed

  def generate(self, prompts, n, sampling):
    if sampling == self._slow:
      self._killed.append(self._worker.pid)
      threading.Timer(0.2, sigkill, (self._worker.pid,)).start()
    return self._worker.generate(prompts, n, sampling)

  def __getattr__(self, name):
    return getattr(self._worker, name)


def test_killed_actor_is_restarted_by_ray_and_the_pool_keeps_running(ray_cluster, params):
  """SIGKILL the actor during a request: the request is dropped (on_drop), Ray restarts the actor,
  the pool re-attaches (restarts >= 1) and the group brings it to the pool's newest weights (a
  restarted actor holds none: a generate would fail the pool); with its restarts used up the actor
  is dead for good (WorkerDied)."""
  from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
  slow = SamplingParams(temperature=1.0, max_tokens=50, seed=1)
  with ray_group.RayRolloutGroup(jax_spec(), 1, max_restarts=1) as group, \
      ray_group.ObjectStorePublisher(CFG, "params", None, keep=2) as pub:
    w0 = pub.publish(params[0], 0)
    w1 = pub.publish(params[1], 1)
    deliveries, dropped, killed, taken = [], [], [], [0]

    def source(index):
      del index
      taken[0] += 1
      if taken[0] == 3:
        return PromptBatch(PROMPTS * 8, 8, slow, meta="doomed")
      return PromptBatch(PROMPTS, 2, SAMPLING, meta=taken[0])

    def make_worker(index):
      return KillDuringSlowCalls(group.make_worker(index, pool.target), slow, killed)

    pool = WorkerPool(make_worker, 1, source,
                      lambda d: deliveries.append((d.policy_version, d.batch.meta)),
                      initial_weights=w0, restart_backoff_s=0.1,
                      on_drop=lambda batch, reason: dropped.append((batch.meta, reason)))
    with pool:
      deadline = time.monotonic() + 120
      while pool.metrics()["restarts"] < 1 or pool.metrics()["per_worker"][0]["version"] is None:
        pool.raise_if_failed()
        assert time.monotonic() < deadline, pool.metrics()
        time.sleep(0.05)
      pool.refresh(w1)
      while not any(v == 1 for v, _ in deliveries):
        pool.raise_if_failed()
        assert time.monotonic() < deadline, pool.metrics()
        time.sleep(0.05)
      metrics = pool.metrics()
    assert metrics["restarts"] == 1 and metrics["failed"] is False and metrics["dropped"] >= 1
    assert dropped[0][0] == "doomed" and isinstance(dropped[0][1], WorkerDied)
    assert all(m != "doomed" for _, m in deliveries)
    new_pid = group.infos[0]["pid"]
    assert killed and new_pid != killed[0]
    versions = [v for v, _ in deliveries]
    assert versions == sorted(versions) and set(versions) == {0, 1}
    print(f"\npool over a killed actor: {metrics['requests']} requests, {metrics['restarts']} "
          f"restart(s), {metrics['dropped']} dropped")

    # Its one restart is used up: killed again, it is dead for good.
    os.kill(new_pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match="dead for good .*rollout.ray_max_restarts=1"):
      group.make_worker(0, w1)


@pytest.mark.slow
def test_vllm_actor_loads_object_store_weights_and_matches_the_jax_model(ray_cluster, params):
  """Through `RolloutBackend` (placement ray, vllm, simulated schedule: one actor): the engine
  starts from the config files it was shipped and loads the object-store state dicts."""
  require("vllm")
  c = defaults.base_config()
  c.rollout.backend = "vllm"
  c.rollout.placement = "ray"
  c.rollout.vllm_max_num_seqs = 32
  c.model.max_len = 128
  backend = backends.RolloutBackend(c, CFG, (CFG.eos_token_id,))
  try:
    assert backend.ray_group.num_workers == 1 and backend.ray_group.num_gpus == 0
    start = time.perf_counter()
    w0 = backend.publish(params[0], 0)
    worker = backend.make_worker(0, w0)
    print(f"\nvLLM actor start + first load: {time.perf_counter() - start:.1f} s (engine "
          f"{worker.info['startup_seconds']:.1f} s); load {worker.last_load_phases}")
    assert worker.policy_version == 0 and worker.call_count is None
    assert_logprobs_match(worker.generate(PROMPTS, 4, SAMPLING), params[0], params[1], 0)
    w1 = backend.publish(params[1], 1)
    phases = worker.load_weights(w1)
    print(f"vLLM actor refresh: {phases}")
    assert phases["bytes"] == backend.publisher.latest.nbytes
    assert_logprobs_match(worker.generate(PROMPTS, 4, SAMPLING), params[1], params[0], 1)
    worker.close()
  finally:
    backend.close()


@jax.jit
def _token_logprobs(params, tokens):
  return logprobs_lib.token_logprobs(CFG, params, tokens[:, :-1], tokens[:, 1:])


def assert_logprobs_match(groups, right, wrong, version):
  """The groups' log-probs are `right`'s (logprobs_lib.token_logprobs on one padded [16, 32] batch:
  one compilation; the tolerance of tests/rollout/vllm/test_engine.py) and far from `wrong`'s."""
  pairs = [(g, c) for g in groups for c in g.completions]
  assert all(g.policy_version == version for g in groups) and len(pairs) <= 16
  tokens = np.zeros((16, 32), np.int32)
  for i, (g, c) in enumerate(pairs):
    seq = np.concatenate([g.prompt_tokens, c.tokens])
    tokens[i, :len(seq)] = seq
  diffs = {}
  for name, p in (("right", right), ("wrong", wrong)):
    lp = np.asarray(_token_logprobs(p, tokens))
    diffs[name] = np.concatenate([
        np.abs(lp[i, len(g.prompt_tokens) - 1:len(g.prompt_tokens) - 1 + len(c.tokens)] - c.logprobs)
        for i, (g, c) in enumerate(pairs)])
  assert diffs["right"].max() < 1e-3 and np.exp(diffs["right"]).mean() <= 1.05, diffs["right"].max()
  assert diffs["wrong"].mean() > 0.05


@pytest.mark.slow
def test_simulated_run_over_a_ray_actor_is_the_local_run(tmp_path, ray_cluster, tiny_reference_run):
  """The simulated schedule's one local worker as a Ray actor: the same run, bit for bit."""
  del ray_cluster
  workdir = str(tmp_path / "run")
  proc = tiny_runs.run_launch(workdir, "--config.rollout.placement=ray")
  assert "rollout actor 0 started" in proc.stderr
  got, want = tiny_runs.read_rows(workdir), tiny_runs.read_rows(tiny_reference_run)
  assert len(got) == len(want) == 7
  for a, b in zip(got, want):
    assert tiny_runs.comparable(a) == tiny_runs.comparable(b), a["step"]


@pytest.mark.parametrize("key,value,message", [
    ("ray_placement_strategy", "TIGHT", r"ray_placement_strategy='TIGHT': expected one of "
                                        r"\('PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'\)"),
    ("ray_address", "nowhere", r"ray_address='nowhere': expected '' \(start a local Ray instance"),
    ("ray_address", "host:99999", "ray_address='host:99999'"),
    ("ray_num_cpus_per_worker", 0.0, "ray_num_cpus_per_worker=0.0 must be > 0"),
    ("ray_num_gpus_per_worker", -2, r"ray_num_gpus_per_worker=-2.0: expected -1 \(auto"),
    ("ray_max_restarts", -3, "ray_max_restarts=-3 must be >= 0"),
])
def test_validate_config_names_bad_ray_keys(key, value, message):
  require("ray")
  c = defaults.base_config()
  c.rollout.placement = "ray"
  validation.validate_config(c)  # the defaults are fine
  c.rollout[key] = value
  with pytest.raises(ValueError, match=message):
    validation.validate_config(c)


def test_bad_settings_fail_naming_the_fix(ray_cluster):
  """A bad strategy, an actor whose constructor fails (Ray does not restart it: WorkerDied with
  its error), an address where nothing answers."""
  from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
  del ray_cluster
  with pytest.raises(ValueError, match="ray_placement_strategy='TIGHT': expected one of"):
    ray_group.RayRolloutGroup(jax_spec(), 1, strategy="TIGHT")
  spec = ray_group.WorkerSpec("bogus", CFG, max_len=64)
  with ray_group.RayRolloutGroup(spec, 1, max_restarts=3) as group:
    with pytest.raises(WorkerDied, match="rollout actor 0 failed to start: ValueError: "
                                         "WorkerSpec.backend='bogus'"):
      group.make_worker(0)
  # Nothing listens on port 1: a clear error at once (Ray alone would retry for minutes). In a
  # fresh interpreter: this one may already be connected to the module's instance.
  code = ("from jaxreplay.rollout.ray import group\n"
          "group.connect('127.0.0.1:1')\n")
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode != 0
  assert "ConnectionError: rollout.ray_address='127.0.0.1:1': nothing answers at 127.0.0.1:1" in \
      proc.stderr, proc.stderr[-2000:]
  assert "ray start --head --port=1" in proc.stderr and "rollout.ray_address=''" in proc.stderr
  assert time.perf_counter() - start < 60
