"""LoRA training (`learner.adapters`, `trainer.make_train_step(..., lora=base)`) on 8 emulated CPU
devices: the train state is the adapters (optimizer state and gradients over them only), the base
never changes, the losses, micro-batches, meshes and KL work as with full weights, checkpoints hold
no base and a resume on another base is refused; the memory plan; the JAX sampler's refresh and the
adapter-directory publisher; multi-turn trajectories (issue 38): the environment's tokens move no
adapter, and a LoRA step on them takes the merged model's gradient."""
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxreplay.config import memory_plan
from jaxreplay.config.defaults import base_config
from jaxreplay.data import collate as collate_lib
from jaxreplay.infra import checkpoint as checkpoint_lib
from jaxreplay.infra import sharding
from jaxreplay.learner import adapters as adapters_lib
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import corrections
from jaxreplay.learner import losses
from jaxreplay.learner import optim
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import lora
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout.base import SamplingParams, StaleWeights, Weights
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.rollout.weights.adapter_publisher import (AdapterDeviceCopyPublisher,
                                                         AdapterDirPublisher)
from tests.helpers import trajectories
from tests.helpers.tolerances import close, tree_scale
from tests.helpers.train_batches import record_grads, with_behaviour

CFG = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
SPEC = lora.LoraSpec(rank=8, alpha=16.0)
B, T, CHUNK = 8, 32, 16
LR = 1e-2


def _mesh(shape):
  return sharding.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])


def _host(x):
  return jax.tree.map(np.asarray, x)


def make_batch(seed=0) -> batch_lib.Batch:
  """Right-padded rows of random prompts and completions, GRPO advantages, behaviour log-probs 0
  (set later); the last row is all padding."""
  rng = np.random.default_rng(seed)
  tokens, positions, segment_ids = (np.zeros((B, T), np.int32) for _ in range(3))
  mask = np.zeros((B, T), np.float32)
  for i in range(B - 1):
    prompt, completion = rng.integers(3, 9), rng.integers(4, 22)
    n = prompt + completion
    tokens[i, :n] = rng.integers(3, CFG.vocab_size, n)
    positions[i, :n] = np.arange(n)
    segment_ids[i, :n] = 1
    mask[i, prompt - 1:n - 1] = 1.0
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
  rewards = rng.integers(0, 2, (2, 4)).astype(np.float32)
  rewards[:, 0], rewards[:, 1] = 1.0, 0.0
  adv = np.array(losses.grpo_advantages(rewards)).reshape(-1)
  adv[-1] = 0.0
  return batch_lib.Batch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                         targets=targets, completion_mask=mask,
                         behaviour_logprobs=np.zeros((B, T), np.float32),
                         advantages=adv.astype(np.float32), rewards=rewards.reshape(-1),
                         policy_version=np.zeros(B, np.int32))


def lora_parts(mesh, loss_fn, k=1, base_params=None, opt=None, donate=True):
  """(base, state, step, logprob_fn) of LoRA training on `mesh` (AdamW at LR unless `opt`)."""
  opt = opt or optim.make_optimizer(LR, eps=1e-3)
  base = adapters_lib.frozen_base(CFG, SPEC, mesh, base_params, rng=jax.random.PRNGKey(0))
  state = adapters_lib.init_adapter_state(CFG, SPEC, opt, jax.random.PRNGKey(1), mesh)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  step = trainer.make_train_step(CFG, opt, loss_fn, mesh, state_sh, num_microbatches=k,
                                 chunk_size=CHUNK, lora=base, donate=donate)
  logprob_fn = trainer.make_logprob_fn(CFG, mesh, state_sh.params, CHUNK, lora=base)
  return base, state, step, logprob_fn


@pytest.fixture(scope="module")
def data():
  base_params = _host(jax.jit(transformer.init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0)))
  mesh = _mesh((1, 1, 1))
  base, state, step, logprob_fn = lora_parts(mesh, loss_fn_lib.make_loss_fn("grpo"), base_params=base_params)
  batch = make_batch()
  lp = np.asarray(logprob_fn(state.params, batch))
  noise = np.random.default_rng(0).normal(0.0, 0.3, lp.shape).astype(np.float32)
  batch = batch._replace(behaviour_logprobs=np.where(batch.completion_mask > 0, lp + noise, 0.0))
  before = _host(state)
  after, metrics = step(state, batch)
  return dict(base_params=base_params, base=base, batch=batch, before=before, after=_host(after),
              metrics=_host(metrics), logprob_fn=logprob_fn)


def test_state_is_the_adapters_and_only_they_change(data):
  before, after, base = data["before"], data["after"], data["base"]
  assert jax.tree.structure(before.params) == jax.tree.structure(
      lora.init_adapters(CFG, SPEC, jax.random.key(0)))
  # AdamW's state covers the adapters only: its leaves are adapter-shaped (or scalar counts)
  shapes = {x.shape for x in jax.tree.leaves(before.params)}
  assert {x.shape for x in jax.tree.leaves(before.opt_state) if x.ndim} <= shapes
  assert before.ref_params is None
  chex.assert_trees_all_equal(_host(base.params), data["base_params"])  # never touched
  for t in SPEC.targets:
    # at b = 0 the gradient of a is exactly 0, so Adam leaves a; b moves
    np.testing.assert_array_equal(after.params[t]["a"], before.params[t]["a"])
    assert np.abs(after.params[t]["b"]).max() > 1e-4
  assert int(after.step) == 1 and np.isfinite(data["metrics"]["loss"])


def test_loss_and_logprobs_equal_the_full_model_at_the_merged_weights(data):
  """The LoRA step's loss at b = 0 is the full model's; after the step the trainer's log-probs are
  those of the merged weights (W + scale a b)."""
  mesh = _mesh((1, 1, 1))
  batch = data["batch"]
  opt = optim.make_optimizer(LR, eps=1e-3)
  full = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=data["base_params"],
                                  mesh=mesh)
  full_step = trainer.make_train_step(CFG, opt, loss_fn_lib.make_loss_fn("grpo"), mesh,
                                      trainer.state_shardings(full, mesh), chunk_size=CHUNK)
  _, full_metrics = full_step(full, batch)
  for key in ("loss", "entropy", "ratio_mean", "clip_fraction"):
    np.testing.assert_allclose(data["metrics"][key], float(full_metrics[key]),
                               **close(np.float32, T, 1.0))
  merged = lora.merge(CFG, data["base_params"], data["after"].params, SPEC)
  full_lp = trainer.make_logprob_fn(CFG, mesh, sharding.param_shardings(merged, mesh), CHUNK)
  want = np.asarray(full_lp(merged, batch))
  got = np.asarray(data["logprob_fn"](data["after"].params, batch))
  np.testing.assert_allclose(got, want, **close(np.float32, CFG.intermediate_size, tree_scale(want)))
  assert np.abs(got - np.asarray(data["logprob_fn"](data["before"].params, batch))).max() > 1e-3


@pytest.mark.parametrize("name", ["grpo", "asymre"])
def test_losses_microbatches_and_meshes_as_with_full_weights(data, name):
  """k=2 micro-batches and an 8-way fsdp mesh (base sharded, adapters replicated) take the step of
  one device and one batch, for both losses."""
  batch = data["batch"]
  results = []
  for mesh_shape, k in (((1, 1, 1), 1), ((1, 1, 1), 2), ((1, 4, 2), 1)):
    mesh = _mesh(mesh_shape)
    base, state, step, _ = lora_parts(mesh, loss_fn_lib.make_loss_fn(name), k, data["base_params"])
    if mesh_shape == (1, 4, 2):
      assert base.params["layers"]["q_proj"].sharding.spec == jax.sharding.PartitionSpec(
          None, "fsdp", "tensor")
      assert state.params["q_proj"]["a"].sharding.is_fully_replicated
    after, metrics = step(state, batch)
    results.append((_host(after.params), float(metrics["loss"])))
  for params, loss in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], **close(np.float32, B * T, 1.0))
    chex.assert_trees_all_close(params, results[0][0], **close(np.float32, B * T, 1.0))


def test_kl_reference_is_the_base(data):
  """kl_coef > 0: the reference is the base (no copy in the state): KL 0 at the first step, > 0
  once the adapters moved."""
  mesh = _mesh((1, 1, 1))
  _, state, step, _ = lora_parts(mesh, loss_fn_lib.make_loss_fn("grpo", kl_coef=0.05),
                                 base_params=data["base_params"])
  assert state.ref_params is None
  kls = []
  for _ in range(3):
    state, metrics = step(state, data["batch"])
    kls.append(float(metrics["kl"]))
  assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[-1] > 1e-6


def test_checkpoint_holds_adapters_not_the_base(data, tmp_path):
  after = data["after"]
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, after, {"lora": data["base"].identity()})
  mesh = _mesh((1, 2, 1))  # restored onto another mesh
  opt = optim.make_optimizer(LR, eps=1e-3)
  abstract = adapters_lib.init_adapter_state(CFG, SPEC, opt, jax.random.PRNGKey(5), mesh)
  restored, host = ckpt.restore(1, abstract_state=abstract)
  chex.assert_trees_all_equal(_host(restored), after)
  assert host["lora"] == data["base"].identity()
  state_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                    os.walk(tmp_path / "ckpt" / "1" / "state") for f in fs)
  base_bytes = sum(x.nbytes for x in jax.tree.leaves(data["base_params"]))
  assert state_bytes < base_bytes / 2, (state_bytes, base_bytes)
  ckpt.close()
  # another base is refused, naming the fix
  other = adapters_lib.FrozenBase(SPEC, None, None, "/other/base", "0" * 64)
  with pytest.raises(ValueError, match=r"another base model.*Set model.path to the original base"):
    adapters_lib.check_resume(host["lora"], other)
  with pytest.raises(ValueError, match=r"no LoRA record"):
    adapters_lib.check_resume(None, data["base"])
  changed = dict(host["lora"], rank=16)
  with pytest.raises(ValueError, match=r"changed rank 16 -> 8"):
    adapters_lib.check_resume(changed, data["base"])
  adapters_lib.check_resume(dict(host["lora"], base_path="/moved"), data["base"])  # same content


def test_base_fingerprint_of_files_and_of_params(tmp_path, data):
  from jaxreplay.models import hf_io  # pylint: disable=g-import-not-at-top
  hf_io.save_hf(CFG, data["base_params"], str(tmp_path / "a"))
  hf_io.save_hf(CFG, data["base_params"], str(tmp_path / "b"))
  fa, fb = (adapters_lib.base_fingerprint(str(tmp_path / d)) for d in "ab")
  assert fa == fb and len(fa) == 64
  changed = dict(data["base_params"], norm=data["base_params"]["norm"] * 2)
  hf_io.save_hf(CFG, changed, str(tmp_path / "c"))
  assert adapters_lib.base_fingerprint(str(tmp_path / "c")) != fa
  assert (adapters_lib.base_fingerprint(params=data["base_params"]) !=
          adapters_lib.base_fingerprint(params=changed))


def test_memory_plan_counts_base_adapters_adam_and_grads():
  c = base_config()
  c.model.preset, c.trainer.num_devices, c.trainer.mesh_shape = "tiny", 4, (1, 4, 1)
  c.buffer.batch_size = 64
  full = memory_plan.plan(c)
  c.model.lora_rank, c.model.lora_targets = 8, ("q_proj", "v_proj")
  plan = memory_plan.plan(c)
  cfg = memory_plan.model_config(c)
  spec = lora.spec_from_config(c.model)
  adapter_bytes = lora.num_params(cfg, spec) * 4
  got = plan["per_device_bytes"]
  assert got["params"] == adapter_bytes  # replicated on every device
  assert 2 * adapter_bytes <= got["opt_state"] <= 2 * adapter_bytes + 64  # mu, nu (+ counts)
  assert got["grads"] == adapter_bytes  # one micro-batch: the gradient, no f32 accumulator
  c.trainer.num_microbatches = 2
  assert memory_plan.plan(c)["per_device_bytes"]["grads"] == 2 * adapter_bytes  # + accumulator
  c.trainer.num_microbatches = 1
  assert got["base_params"] == full["per_device_bytes"]["params"]  # sharded as full params are
  assert got["total"] < full["per_device_bytes"]["total"]
  assert plan["lora"]["adapter_params"] == lora.num_params(cfg, spec)
  assert "lora" not in full and "base_params" not in full["per_device_bytes"]
  assert "LoRA: rank 8" in memory_plan.format_plan(plan)


def test_jax_sampler_refresh_matches_the_trainer(data):
  """The JAX rollout path: the publisher's handle is the base with a copy of the adapters, and
  the sampler's log-probs are the trainer's at that version (and not the initial policy's)."""
  base, batch = data["base"], data["batch"]
  publisher = AdapterDeviceCopyPublisher(CFG, base)
  adapters = jax.device_put(data["after"].params)
  weights = publisher.publish(adapters, 1)
  assert publisher.latest.nbytes == lora.num_params(CFG, SPEC) * 4
  sampler = JaxSampler(CFG, base.model_params(data["before"].params), 40, batch_size=16,
                       policy_version=0, seed=3)
  sampler.load_weights(weights)
  prompts = [batch.tokens[i, :5] for i in range(4)]
  groups = sampler.generate(prompts, 4, SamplingParams(max_tokens=12, temperature=1.0))
  assert {g.policy_version for g in groups} == {1}
  rows = [np.concatenate([g.prompt_tokens, c.tokens]) for g in groups for c in g.completions]
  tokens, segment_ids = np.zeros((16, T), np.int32), np.zeros((16, T), np.int32)
  mask = np.zeros((16, T), np.float32)
  sampled = np.zeros((16, T), np.float32)
  for i, (r, (g, c)) in enumerate(zip(rows, [(g, c) for g in groups for c in g.completions])):
    tokens[i, :len(r)], segment_ids[i, :len(r)] = r, 1
    mask[i, 4:len(r) - 1] = 1.0  # targets 5.. (the completion) are predicted at 4..
    sampled[i, 4:len(r) - 1] = c.logprobs
  probe = batch_lib.Batch(tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (16, 1)),
                          segment_ids=segment_ids,
                          targets=np.concatenate([tokens[:, 1:], np.zeros((16, 1), np.int32)], 1),
                          completion_mask=mask, behaviour_logprobs=sampled,
                          advantages=np.zeros(16, np.float32), rewards=np.zeros(16, np.float32),
                          policy_version=np.ones(16, np.int32))
  trainer_lp = np.asarray(data["logprob_fn"](adapters, probe))
  initial_lp = np.asarray(data["logprob_fn"](data["before"].params, probe))
  valid = mask > 0
  np.testing.assert_allclose(sampled[valid], trainer_lp[valid], **close(np.float32, CFG.vocab_size,
                                                                        10.0))
  assert np.abs(sampled[valid] - initial_lp[valid]).max() > 1e-3
  # the adapters were copied: donating the trainer's buffers leaves the handle intact
  adapters = jax.tree.map(lambda x: x.delete(), adapters)
  assert np.isfinite(np.asarray(weights.params["layers"]["q_proj"].b)).all()


def test_adapter_dir_publisher_versions_keep_and_format(data, tmp_path):
  adapters = data["after"].params
  with AdapterDirPublisher(CFG, SPEC, "bfloat16", root=str(tmp_path), keep=2,
                           base_model_name_or_path="/base") as publisher:
    handles = [publisher.publish(adapters, v) for v in (3, 4, 5)]
    assert [h.version for h in handles] == [3, 4, 5] and handles[0].params is None
    assert not os.path.exists(handles[0].lora_dir)  # keep=2
    spec, loaded = lora.load_peft(handles[-1].lora_dir, CFG)
    assert spec == lora.LoraSpec(8, 16.0, dtype="bfloat16")
    chex.assert_trees_all_close(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), adapters))
    record = publisher.latest
    assert record.location == handles[-1].lora_dir and record.nbytes == lora.num_params(CFG, SPEC) * 2
    assert record.stall_s >= record.write_s > 0
    with open(os.path.join(handles[-1].lora_dir, "adapter_config.json")) as f:
      assert json.load(f)["base_model_name_or_path"] == "/base"
    assert handles[-1].portable().lora_dir == handles[-1].lora_dir
    with pytest.raises(ValueError, match="not newer"):
      publisher.publish(adapters, 5)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left


@pytest.mark.slow
def test_lora_run_killed_and_resumed_equals_an_uninterrupted_one(tmp_path):
  """`python -m jaxreplay.launch` (the shortened tiny config, JAX sampler) with model.lora_rank=8:
  killed after checkpoint 4 and resumed, it ends where an uninterrupted run ends (rows and
  adapters bit for bit); a resume on another base, or with another rank, is refused by name."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from tests.helpers.tiny_runs import comparable, read_rows, run_launch, start  # pylint: disable=g-import-not-at-top
  extra = ("--config.model.lora_rank=8", "--config.trainer.learning_rate=1e-3")
  reference, workdir = str(tmp_path / "reference"), str(tmp_path / "killed")
  run_launch(reference, *extra)
  proc = start(workdir, *extra)
  deadline = time.monotonic() + 300
  while not os.path.isdir(os.path.join(workdir, "checkpoints", "4")):
    assert proc.poll() is None and time.monotonic() < deadline, "the run ended before checkpoint 4"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  out = run_launch(workdir, *extra)
  assert "resumed at step 4" in out.stderr
  rows, ref_rows = read_rows(workdir), read_rows(reference)
  assert [r["step"] for r in rows] == list(range(7))
  assert [comparable(r) for r in rows] == [comparable(r) for r in ref_rows]
  ckpts = [checkpoint_lib.Checkpointer(os.path.join(d, "checkpoints"), create=False)
           for d in (workdir, reference)]
  (state, host), (ref_state, _) = (ck.restore(6) for ck in ckpts)
  for ck in ckpts:
    ck.close()
  chex.assert_trees_all_equal(state["params"], ref_state["params"])
  assert set(state["params"]) == set(lora.TARGETS) and host["lora"]["rank"] == 8
  for name in ("hf", "hf_adapter"):
    assert os.path.isdir(os.path.join(workdir, name))
  # Another base (the reference's merged export: other content) is refused by name.
  out = run_launch(workdir, *extra, f"--config.model.path={reference}/hf", expect_rc=None)
  assert out.returncode != 0 and "on another base model" in out.stderr, out.stderr[-2000:]
  out = run_launch(workdir, "--config.model.lora_rank=16", expect_rc=None)
  assert out.returncode != 0 and "model.lora_rank 8 -> 16" in out.stderr, out.stderr[-2000:]


def test_regime_diagnostics_measure_the_adapters(data):
  """With LoRA the diagnostics' gradients are the adapters' (what the optimizer updates):
  grad_sq_big equals |d loss / d adapters|^2 computed with jax.grad over `lora.attach`, and the
  off-policy statistics equal the full model's at the same (merged) weights; the update-KL probe
  runs on the adapted model."""
  from jaxreplay.learner import diagnostics  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import logprobs as logprobs_lib  # pylint: disable=g-import-not-at-top
  mesh = _mesh((1, 1, 1))
  base, batch, adapters = data["base"], data["batch"], data["after"].params
  loss_fn = loss_fn_lib.make_loss_fn("grpo")
  shardings = jax.tree.map(lambda _: sharding.replicated(mesh), adapters)
  fn = diagnostics.make_diagnostics_fn(CFG, loss_fn, mesh, shardings, splits=2, chunk_size=CHUNK,
                                       lora=base)
  got = _host(fn(adapters, None, batch))

  def loss_of(a):
    p = lora.attach(base.params, a, SPEC)
    lp = logprobs_lib.token_logprobs(CFG, p, batch.tokens, batch.targets, batch.positions,
                                     batch.segment_ids, chunk_size=CHUNK)
    return loss_fn(lp, batch)[0]
  g = jax.grad(loss_of)(adapters)
  want = float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g)))
  np.testing.assert_allclose(got["grad_sq_big"], want, **close(np.float32, T * CFG.vocab_size))
  merged = lora.merge(CFG, data["base_params"], adapters, SPEC)
  full = diagnostics.make_diagnostics_fn(CFG, loss_fn, mesh, sharding.param_shardings(merged, mesh),
                                         splits=2, chunk_size=CHUNK)(merged, None, batch)
  for key in ("behaviour_kl_k3", "ratio_p50", "is_ess", "ratio_outside_clip"):
    np.testing.assert_allclose(got[key], float(full[key]), **close(np.float32, T, 1.0))
  probe = diagnostics.make_probe_fn(CFG, mesh, shardings, lora=base)
  kl = diagnostics.policy_kl(probe(data["before"].params, batch), probe(adapters, batch),
                             batch.completion_mask)
  assert float(kl) > 0.0 and np.isfinite(float(kl))


# ---- multi-turn trajectories (issue 38) ---------------------------------------------------------

TRAJ_BUCKETS = (64,)


def _trajectory_parts(data, pack, opt=None):
  """(state, step, batch, env, rollouts): LoRA training (GRPO, TIS, KL to the base, not donating)
  from adapters whose b is nonzero (so both a and b have gradients), on a batch mixing single- and
  multi-turn rows (`tests.helpers.trajectories`) with behaviour log-probs near the adapted model's;
  env: bool [B, T], the environment's target positions."""
  mesh = _mesh((1, 1, 1))
  loss_fn = loss_fn_lib.make_loss_fn("grpo", kl_coef=0.05,
                                 off_policy=corrections.OffPolicyOptions(off_policy="tis"))
  _, state, step, logprob_fn = lora_parts(mesh, loss_fn, base_params=data["base_params"], opt=opt,
                                          donate=False)
  rng = np.random.default_rng(7)
  adapters = {t: {"a": ab["a"], "b": rng.normal(0, 0.05, ab["b"].shape).astype(np.float32)}
              for t, ab in _host(state.params).items()}
  state = state.replace(params=jax.device_put(adapters, jax.tree.map(lambda x: x.sharding,
                                                                     state.params)))
  rollouts = trajectories.mixed_rollouts(seed=2, vocab=CFG.vocab_size, n=B)
  kw = dict(buckets=TRAJ_BUCKETS, pack=pack, batch_size=B)
  batch = collate_lib.collate(rollouts, **kw)
  batch = with_behaviour(batch, np.asarray(logprob_fn(state.params, batch)), seed=4)
  env = trajectories.env_positions(rollouts, **kw)
  assert env.sum() > 10 and (batch.completion_mask > 0).sum() > 20
  return state, step, loss_fn, batch, env, rollouts


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_environment_tokens_move_no_adapter(data, pack):
  """tests/learner/test_batch.py's check through the LoRA path: changing the environment's target
  tokens (what the policy would be trained to predict there; its inputs, the later turns' context,
  stay) and their behaviour log-probs leaves the adapters' update, the loss and every statistic
  bit-identical; the same change at one policy token moves the update."""
  state, step, _, batch, env, rollouts = _trajectory_parts(data, pack)
  moved = trajectories.moved_env_targets(batch, env, CFG.vocab_size)
  after, metrics = _host(step(state, batch))
  after2, metrics2 = _host(step(state, moved))
  chex.assert_trees_all_equal(after.params, after2.params)
  chex.assert_trees_all_equal(after.opt_state, after2.opt_state)
  assert metrics["tokens"] == float(sum(r.policy_tokens for r in rollouts))
  assert set(metrics2) == set(metrics)
  for key in metrics:
    assert float(metrics2[key]) == float(metrics[key]), key
  for t in SPEC.targets:  # both factors were trained
    for f in ("a", "b"):
      assert np.abs(after.params[t][f] - _host(state.params)[t][f]).max() > 0, (t, f)
  after3, _ = step(state, trajectories.poked_policy_target(batch, CFG.vocab_size))
  assert not np.array_equal(np.asarray(after3.params["q_proj"]["b"]), after.params["q_proj"]["b"])


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_lora_step_on_trajectories_takes_the_merged_models_gradient(data, pack):
  """A LoRA step on mixed trajectories against a reference computed without the LoRA path: the
  full-weights loss (`token_logprobs` at the merged weights W + scale a b of `lora.merge`, the
  base's log-probs as the KL reference) differentiated w.r.t. the adapters. The step's loss and
  its raw gradients (`record_grads`) are the reference's."""
  opt = optax.chain(record_grads(), optim.make_optimizer(LR, eps=1e-3))
  state, step, loss_fn, batch, _, _ = _trajectory_parts(data, pack, opt)
  after, metrics = _host(step(state, batch))
  base = jax.tree.map(jnp.asarray, data["base_params"])  # jax arrays: merge stays traceable

  def token_lp(params):
    return logprobs_lib.token_logprobs(CFG, params, batch.tokens, batch.targets, batch.positions,
                                       batch.segment_ids, chunk_size=CHUNK,
                                       single_sequence_rows=not batch.packed)

  def reference_loss(adapters):
    return loss_fn(token_lp(lora.merge(CFG, base, adapters, SPEC)), batch, token_lp(base))[0]

  want_loss, want = jax.value_and_grad(reference_loss)(_host(state.params))
  np.testing.assert_allclose(metrics["loss"], float(want_loss), **close(np.float32, B * 64, 1.0))
  got = after.opt_state[0]
  chex.assert_trees_all_close(got, _host(want), **close(np.float32, B * 64 * CFG.vocab_size,
                                                          tree_scale(want)))
  assert tree_scale(want) > 1e-3
