"""LoRA on vLLM engines (CPU build, PunicaWrapperCPU): adapter-only refreshes through vLLM's own
LoRA support, one adapter id per policy version; the engines' log-probs equal the trainer's at
each version (and not the initial policy's), also under the async schedule, where the peers' most
common LoRA bug (the adapter never reaches the engine) would show; the PEFT export loads in vLLM's
LoRA loader."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import hf_io
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.models import lora
from jaxreplay.rollout.base import SamplingParams, StaleWeights, Weights
from jaxreplay.rollout.weights.adapter_publisher import AdapterDirPublisher
from tests.helpers.deps import require
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow  # vLLM engines start in seconds each

CFG = presets.tiny()
SPEC = lora.LoraSpec(rank=8, alpha=16.0)
PROMPTS = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10, 11, 12, 13], np.int32),
           np.array([1, 40], np.int32)]
ROWS, COLS = 16, 40


def random_adapters(seed, scale=0.05):
  adapters = lora.init_adapters(CFG, SPEC, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(adapters)))
  return {t: {"a": ab["a"], "b": scale * jax.random.normal(next(keys), ab["b"].shape)}
          for t, ab in adapters.items()}


def logprob_gap(groups, params):
  """Max |engine - JAX forward| log-prob over every sampled token of `groups`."""
  pairs = [(g, c) for g in groups for c in g.completions]
  seqs = [np.concatenate([g.prompt_tokens, c.tokens]) for g, c in pairs]
  gaps = []
  for start in range(0, len(seqs), ROWS):
    chunk = seqs[start:start + ROWS]
    tokens = np.zeros((ROWS, COLS), np.int32)
    for i, s in enumerate(chunk):
      tokens[i, :len(s)] = s
    lp = np.asarray(jax.jit(logprobs_lib.token_logprobs, static_argnums=0)(CFG, params, tokens[:, :-1],
                                                                      tokens[:, 1:]))
    for i, ((g, c), s) in enumerate(zip(pairs[start:start + ROWS], chunk)):
      gaps.append(np.abs(lp[i, len(g.prompt_tokens) - 1:len(s) - 1] - c.logprobs).max())
  return float(max(gaps))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  require("vllm")
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("lora")
  base = transformer.init_params(CFG, jax.random.key(0))
  base_dir = str(root / "base")
  hf_io.save_hf(CFG, jax.device_get(base), base_dir)
  engine = VllmEngine(base_dir, max_lora_rank=lora.vllm_max_lora_rank(SPEC.rank),
                      max_model_len=128, max_num_seqs=64, seed=0, policy_version=-1)
  publisher = AdapterDirPublisher(CFG, SPEC, "float32", root=str(root / "versions"), keep=3,
                                  base_model_name_or_path=base_dir)
  yield engine, base, base_dir, publisher, root
  engine.close()
  publisher.close()


def test_engine_refreshes_adapters_per_version(setup):
  engine, base, _, publisher, _ = setup
  sampling = SamplingParams(temperature=1.0, max_tokens=24)
  with pytest.raises(RuntimeError, match="loaded no weights"):
    engine.generate(PROMPTS, 2, sampling)  # the base alone is not the policy
  versions = {v: random_adapters(v) for v in (1, 2)}
  for v, adapters in versions.items():
    phases = engine.load_weights(publisher.publish(adapters, v))
    assert phases["bytes"] > 0 and engine.policy_version == v
    assert engine.loaded_adapters() == [v + 1]  # the previous version's adapter is gone
    groups = engine.generate(PROMPTS, 4, sampling)
    assert {g.policy_version for g in groups} == {v}
    gap = logprob_gap(groups, lora.attach(base, adapters, SPEC))
    other = versions[3 - v]
    print(f"\nversion {v}: max |vLLM - JAX| {gap:.2e}; vs base "
          f"{logprob_gap(groups, base):.2e}, vs the other version "
          f"{logprob_gap(groups, lora.attach(base, other, SPEC)):.2e}")
    assert gap < 1e-3
    assert logprob_gap(groups, base) > 0.05  # the adapter reached the engine
    assert logprob_gap(groups, lora.attach(base, other, SPEC)) > 0.05


def test_superseded_adapter_is_stale_and_the_engine_keeps_its_version(setup):
  engine, _, _, publisher, _ = setup
  old = publisher.publish(random_adapters(3), 3)
  for v in (4, 5, 6):
    newest = publisher.publish(random_adapters(v), v)
  with pytest.raises(StaleWeights, match="is gone"):
    engine.load_weights(old)
  engine.load_weights(newest)
  assert engine.policy_version == 6 and engine.loaded_adapters() == [7]


def test_peft_export_loads_in_vllms_lora_loader(setup):
  """WORKDIR/hf_adapter (`lora.save_peft`, the adapters' own dtype) through vLLM's loader."""
  engine, base, base_dir, _, root = setup
  adapters = random_adapters(9)
  export = str(root / "hf_adapter")
  lora.save_peft(export, CFG, SPEC, jax.device_get(adapters), base_model_name_or_path=base_dir)
  engine.load_weights(Weights(100, lora_dir=export))
  groups = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_tokens=24))
  assert logprob_gap(groups, lora.attach(base, adapters, SPEC)) < 1e-3
  assert logprob_gap(groups, base) > 0.05


def test_engine_core_in_its_own_process(setup):
  """The GPU default (vLLM's engine-core process): add_lora / remove_lora reach it too."""
  from jaxreplay.rollout.vllm.engine import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
  _, base, base_dir, publisher, _ = setup
  worker = VllmWorkerProcess(base_dir, max_lora_rank=8, max_model_len=128, max_num_seqs=16,
                             seed=0, policy_version=-1,
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
  try:
    for v in (10, 11):
      adapters = random_adapters(v)
      worker.load_weights(publisher.publish(adapters, v))
      groups = worker.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=16))
      assert {g.policy_version for g in groups} == {v}
      assert logprob_gap(groups, lora.attach(base, adapters, SPEC)) < 1e-3
    assert worker.loaded_adapters() == [12]
  finally:
    worker.close()


def test_async_run_engines_sample_every_refreshed_version(tmp_path, monkeypatch):
  """configs/tiny.py with LoRA on a vLLM engine under scheduler.kind=async: every batch row's
  sampler log-probs (the engine's, at the version the row is tagged with) equal the trainer's at
  that version's adapters, and differ from the initial policy's once the adapters moved: every
  adapter version reached the engine, the failure the peers' LoRA trackers report most."""
  require("vllm")
  from jaxreplay.run import build as build_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(REPO, "configs",
                                                                          "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  c = tiny.get_config()
  c.total_steps, c.trainer.warmup_steps, c.trainer.learning_rate = 8, 1, 1e-2
  c.model.lora_rank, c.model.lora_alpha = 8, 16.0
  c.rollout.backend, c.scheduler.kind, c.rollout.num_workers = "vllm", "async", 1
  c.rollout.group_size, c.rollout.prompts_per_request = 4, 4
  # On-policy queue: each step waits for fresh rollouts (replay would let this fast trainer take
  # every step from the first rollouts before the engine delivers more).
  c.buffer.size, c.buffer.batch_size, c.buffer.on_policy = 32, 32, True
  c.eval.every, c.eval.num_problems, c.eval.n_samples, c.eval.ks = 0, 8, 1, (1,)
  c.checkpoint.every = 0
  snapshots, batches, seen, build = {}, [], [], build_lib.build

  def recording_build(*args):
    parts = build(*args)
    publish, train_step = parts.generation.rollouts.publish, parts.learner.train_step

    def recording_publish(params, version):  # the adapters of every published version
      snapshots[int(version)] = jax.tree.map(np.array, jax.device_get(params))
      return publish(params, version)

    def recording_step(state, batch):
      batches.append(batch)
      return train_step(state, batch)

    parts.generation.rollouts.publish, parts.learner.train_step = recording_publish, recording_step
    seen.append(parts)
    return parts

  monkeypatch.setattr(build_lib, "build", recording_build)
  pipeline_lib.run(c, str(tmp_path / "run"))
  logprob_fn = seen[0].learner.logprob_fn
  results = []  # (version, rows, max |engine - trainer at that version|, max |engine - initial|)
  for batch in batches:
    initial_lp = np.asarray(logprob_fn(snapshots[0], batch))
    for v in sorted(set(batch.policy_version.tolist())):
      valid = (batch.completion_mask > 0) & (batch.policy_version == v)[:, None]
      if not valid.any():
        continue
      trainer_lp = np.asarray(logprob_fn(snapshots[v], batch))
      results.append((v, int((batch.policy_version == v).sum()),
                      float(np.abs(trainer_lp - batch.behaviour_logprobs)[valid].max()),
                      float(np.abs(initial_lp - batch.behaviour_logprobs)[valid].max())))
  print("\n(version, rows, max |engine - trainer|, max |engine - initial policy|):",
        [(v, n, f"{a:.1e}", f"{b:.1e}") for v, n, a, b in results])
  versions = {r[0] for r in results}
  assert len(versions - {0, 1}) >= 3, results  # rows of several refreshed versions were trained on
  for version, _, to_trainer, to_initial in results:
    assert to_trainer < 1e-3, (version, to_trainer)
    if version >= 2:
      assert to_initial > 20 * max(to_trainer, 1e-5), (version, to_trainer, to_initial)
  assert os.path.isfile(tmp_path / "run" / "hf_adapter" / "adapter_model.safetensors")
