"""The simulated (virtual-time) schedule over fake hooks: event order, weights reaching the
workers, determinism and its resumed clock, failures."""
import dataclasses
import types

import numpy as np
import pytest

from jaxreplay.rollout.base import PromptBatch, SamplingParams, Weights
from jaxreplay.run.schedules import GenerationCost, SimState, SimulatedScheduler
from tests.helpers.schedule_fakes import FakeHooks, FakeIntake, FakeWorker, simulated


def test_simulated_schedule_timeline_and_weights():
  log = []
  hooks = FakeHooks(batch=2, total=3)
  sched = simulated(lambda i, w: FakeWorker(w, log), 2, 1)
  sched.run(hooks)
  # Two workers start at t=0 with version 0; their requests end at t=2; steps take 1 s each.
  assert [e[:3] for e in hooks.events if e[0] == "train"] == [("train", 0, 2.0), ("train", 1, 3.0),
                                                              ("train", 2, 4.0)]
  # Requests delivered at t=2 and t=4 started at t=0 and t=2, before the first update ended (t=3).
  assert hooks.intake.delivered_versions == [0, 0, 0, 0]
  # The requests started at t=4 (still in flight at the end, t=5) used the weights of step 2.
  assert log == [("make", 0), ("load", 2), ("close", 2)]
  st = sched.state
  assert st.clock == 5.0 and st.training_device_seconds == 3.0
  assert st.generation_device_seconds == 2.0 * st.requests


def test_a_steps_share_of_training_is_its_virtual_cost():
  """An update on a minibatch of B / m rollouts (trainer.ppo_minibatches, `Hooks.train_share`)
  costs 1/m of train_device_seconds and takes 1/m of a step's time on the clock."""
  class HalfSteps(FakeHooks):
    def train_share(self, step):
      del step
      return 0.5
  hooks = HalfSteps(batch=2, total=3)
  sched = simulated(lambda i, w: FakeWorker(w, []), 2, 1, train=1.0)
  sched.run(hooks)
  # requests end at t=2; the three half-steps start at 2.0, 2.5, 3.0 and end at 3.5
  assert [e[2] for e in hooks.events if e[0] == "train"] == [2.0, 2.5, 3.0]
  assert sched.state.training_device_seconds == 1.5 and sched.state.clock == 3.5


def test_workers_desynchronise_when_completion_lengths_differ():
  """Requests whose completions differ in length take different times, so deliveries spread out
  and batches mix policy versions: in-batch staleness varies on most steps (N >> one request)."""
  lengths = lambda p: 1 + int(p[1]) % 7  # 1..7 tokens, by request
  hooks = FakeHooks(batch=8, total=40)
  sched = simulated(lambda i, w: FakeWorker(w, [], lengths), 4, 1, seconds_per_rollout=0.25,
                    reference_tokens=4.0)
  sched.run(hooks)
  trains = [e for e in hooks.events if e[0] == "train"]
  mixed = [len(set(e[3])) > 1 for e in trains[5:]]
  assert np.mean(mixed) > 0.5, mixed
  # With equal lengths the four workers stay in lockstep: every delivery window holds one version.
  hooks = FakeHooks(batch=8, total=40)
  simulated(lambda i, w: FakeWorker(w, []), 4, 1, seconds_per_rollout=0.25).run(hooks)
  trains = [e for e in hooks.events if e[0] == "train"]
  assert np.mean([len(set(e[3])) > 1 for e in trains[5:]]) < np.mean(mixed)


def test_simulated_schedule_is_deterministic_and_resumes_its_clock():
  def run(state):
    hooks = FakeHooks(batch=4, consume=True, total=5)
    sched = simulated(lambda i, w: FakeWorker(w, []), 3, 2, seconds_per_rollout=0.7, state=state,
                      train=1.3)
    sched.run(hooks)
    return hooks.events, state
  (a, sa), (b, sb) = run(SimState(reference_tokens=2.0)), run(SimState(reference_tokens=2.0))
  assert a == b and sa == sb
  resumed = SimState(clock=100.0, generation_device_seconds=5.0, reference_tokens=2.0)
  events, _ = run(resumed)
  assert events[0][2] >= 100.0 and resumed.generation_device_seconds > 5.0


def test_simulated_schedule_reports_a_stuck_pipeline():
  hooks = FakeHooks(batch=8, consume=True, capacity=4, total=1)  # the queue never holds a batch
  with pytest.raises(RuntimeError, match="stuck"):
    simulated(lambda i, w: FakeWorker(w, []), 1, 1).run(hooks)


def test_simulated_schedule_rejects_bad_costs():
  with pytest.raises(ValueError, match="W >= 1"):
    simulated(None, 0, 1)
  with pytest.raises(ValueError, match="must be > 0"):
    simulated(None, 1, 1, seconds_per_rollout=0.0)


# ---- generation_batch K > 1: requests generated ahead, on a real JAX sampler --------------------

class IndexedIntake(FakeIntake):
  """Requests of one prompt from a cursor, meta = [(index, problem)] as `Intake` gives them, with
  the `prompts.problem` / `codec.encode_prompt` that `upcoming_requests` reads; records the groups
  delivered per prompt index."""

  def __init__(self, capacity=None):
    super().__init__(capacity)
    self.prompts = self.codec = self
    self.cursor, self.delivered = 0, {}

  def problem(self, index):
    return types.SimpleNamespace(prompt=f"problem {index}")

  def encode_prompt(self, text):
    index = int(text.split()[1])
    return np.random.default_rng(index).integers(1, 32, size=2 + index % 5).astype(np.int32)

  def _batch(self, index):
    items = [(index, self.problem(index))]
    return PromptBatch([self.encode_prompt(p.prompt) for _, p in items], 2, SAMPLED, meta=items)

  def next_request(self):
    if super().next_request() is None:
      return None
    self.cursor += 1
    return self._batch(self.cursor - 1)

  def restore_request(self, indices):  # this intake lives on: the request is still in flight
    return self._batch(indices[0])

  def deliver(self, batch, groups, rewards=None):
    super().deliver(batch, groups, rewards)
    self.delivered[batch.meta[0][0]] = (groups[0].policy_version,
                                        [c.tokens.tolist() for c in groups[0].completions])


SAMPLED = SamplingParams(temperature=1.0, max_tokens=6)


def _params(version, cache={}):
  """Each published version has its own (random) weights, so a request's tokens show them."""
  if version not in cache:
    import jax  # pylint: disable=g-import-not-at-top
    from jaxreplay.models import presets, transformer  # pylint: disable=g-import-not-at-top
    cfg = presets.tiny(vocab_size=32, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16)
    cache[version] = (cfg, transformer.init_params(cfg, jax.random.key(version), std=0.3))
  return cache[version]


class ModelHooks(FakeHooks):
  """FakeHooks whose intake is an `IndexedIntake` and whose weights carry real parameters."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.intake = IndexedIntake(kwargs.get("capacity"))
    self.weights = self._weights(0)

  def _weights(self, version):
    cfg, params = _params(version)
    return Weights(version, params=params, cfg=cfg)

  def publish_if_due(self, step):
    if step % self.refresh_every:
      return None
    self.weights = self._weights(step)
    return self.weights


def _jax_worker(index, weights):
  from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  return JaxSampler(weights.cfg, weights.params, max_len=16, batch_size=8, eos_token_ids=(3,),
                    seed=1, policy_version=weights.version)


def _run_model(k, total=6, state=None, sched=None, hooks=None, **hook_kwargs):
  hooks = hooks or ModelHooks(total=total, **hook_kwargs)
  state = state or SimState(reference_tokens=3.0)
  sched = sched or SimulatedScheduler(_jax_worker, 3, 1, GenerationCost(0.4, 0.1, state), 1.0,
                                      state, generation_batch=k)
  sched.run(hooks)
  return hooks, state, sched


@pytest.mark.parametrize("k,kwargs", [(4, {}), (5, {"batch": 4, "consume": True, "capacity": 12})])
def test_generation_batch_gives_each_request_its_one_request_groups(k, kwargs):
  """K requests per sampler call, discarded when newer weights arrive: every request gets the
  tokens, version and virtual cost it gets with K = 1 (replay, and an on-policy queue)."""
  one, one_state, _ = _run_model(1, **kwargs)
  many, many_state, sched = _run_model(k, **kwargs)
  assert many.intake.delivered == one.intake.delivered and len(one.intake.delivered) > 10
  assert len({v for v, _ in one.intake.delivered.values()}) >= 3  # the weights changed
  assert many.events == one.events
  strip = lambda s: {**dataclasses.asdict(s), "speculative_rows": 0, "speculative_discarded": 0}
  assert strip(many_state) == strip(one_state)
  assert one_state.speculative_rows == one_state.speculative_discarded == 0
  # Some requests were served from a batched call, some results were thrown away at a refresh.
  assert 0 < many_state.speculative_discarded < many_state.speculative_rows
  assert many_state.speculative_rows % 2 == 0  # whole requests of 2 rollouts
  assert len(many.generated_seconds) == len(one.generated_seconds) == one_state.requests
  assert sched.worker.state_dict()["ahead"]  # results of the requests not started yet


def test_generation_batch_resumes_from_its_state_dict():
  """A run stopped at step 3 and continued by a new scheduler (in-flight requests and the results
  generated ahead restored from `state_dict`, through the checkpoint's host-state encoding) ends
  as the uninterrupted run does."""
  from jaxreplay.infra import checkpoint  # pylint: disable=g-import-not-at-top
  whole, whole_state, _ = _run_model(4, total=6)
  hooks, state, sched = _run_model(4, total=3)
  saved = sched.state_dict()
  assert saved["ahead"] and all(a["version"] <= 3 for a in saved["ahead"])
  saved = checkpoint.decode_host_state(checkpoint.encode_host_state(saved))
  resumed_state = SimState(**dataclasses.asdict(state))
  resumed = SimulatedScheduler(_jax_worker, 3, 1, GenerationCost(0.4, 0.1, resumed_state), 1.0,
                               resumed_state, generation_batch=4)
  resumed.load_state_dict(saved)
  hooks.total = 6
  _run_model(4, hooks=hooks, state=resumed_state, sched=resumed)
  assert hooks.intake.delivered == whole.intake.delivered
  assert hooks.events == whole.events and resumed_state == whole_state


def test_generation_batch_auto_and_errors():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxreplay.run.schedules import base, simulated as simulated_lib  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict({
      "rollout": {"prompts_per_request": 1, "group_size": 8, "sampler_batch_size": 32},
      "scheduler": {"generation_batch": 0}})
  assert simulated_lib.resolve_generation_batch(c) == 4  # 4 x 8 rows fill one batch of 32
  c.rollout.group_size = 48
  assert simulated_lib.resolve_generation_batch(c) == 2  # 96 rows: 3 full batches
  c.rollout.group_size = 64
  assert simulated_lib.resolve_generation_batch(c) == 1  # a request fills 2 batches alone
  c.scheduler.generation_batch = 7
  assert simulated_lib.resolve_generation_batch(c) == 7
  with pytest.raises(ValueError, match="generation_batch=0 must be >= 1"):
    base.LocalWorker(_jax_worker, SimState(), 0)
  with pytest.raises(ValueError, match="pass its state"):
    base.LocalWorker(_jax_worker, None, 2)
  state = SimState()
  sched = SimulatedScheduler(lambda i, w: FakeWorker(w, []), 1, 1, GenerationCost(1.0, 0.0, state),
                             1.0, state, generation_batch=2)
  with pytest.raises(TypeError, match="needs a rollout worker with generate_requests"):
    sched.run(ModelHooks(total=1))
