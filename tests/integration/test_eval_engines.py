"""Evaluation on the rollout engines (config.eval.backend="engines") in whole runs.

- JAX backend, async schedule: the evaluation's requests are split over the pool's workers.
- JAX backend, simulated schedule: evaluating on the rollout worker instead of the trainer's eval
  sampler changes no training metric, gives the same greedy pass@1, counts its generate calls in the
  host state (`eval_calls`), and a run resumed from a checkpoint evaluates as the uninterrupted one.
- vLLM backend (eval.backend auto -> engines): the eval requests reach the engine process, no
  trainer-side eval sampler is built, and the greedy pass@1 equals the JAX sampler's on the same
  weights.
"""
import json
import os
import shutil

import numpy as np
import pytest

from jaxreplay.infra import checkpoint as checkpoint_lib
from tests.helpers.deps import require
from tests.helpers.tiny_runs import REPO, comparable, read_rows, run_launch

pytestmark = pytest.mark.slow  # whole runs

GREEDY = ("--config.eval.temperature_pass1=0.0",)


def _host(workdir, step):
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
  try:
    return ckpt.restore(step)[1]
  finally:
    ckpt.close()


def _resolved_eval_backend(workdir):
  with open(os.path.join(workdir, "run_config.json")) as f:
    return json.load(f)["eval"]["backend"]


def _without_eval(row):
  return {k: v for k, v in comparable(row).items() if not k.startswith("eval/")}


def test_jax_engines_eval_leaves_training_unchanged_and_resumes(tmp_path):
  engines, trainer = str(tmp_path / "engines"), str(tmp_path / "trainer")
  on_engines = (*GREEDY, "--config.eval.backend=engines")
  run_launch(engines, *on_engines)
  run_launch(trainer, *GREEDY)  # auto -> trainer on the JAX backend
  assert _resolved_eval_backend(engines) == "engines"
  assert _resolved_eval_backend(trainer) == "trainer"
  rows, ref = read_rows(engines), read_rows(trainer)
  assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(7))
  # Where evaluation runs changes no training metric (the worker's rollout noise is untouched).
  assert [_without_eval(r) for r in rows] == [_without_eval(r) for r in ref]
  evals = [r for r in rows if "eval/pass@1" in r]
  assert [r["step"] for r in evals] == [0, 3, 6]
  # Greedy pass@1 is the argmax of the same params whichever JAX sampler runs it.
  for r, q in zip(evals, [q for q in ref if "eval/pass@1" in q]):
    assert r["eval/pass@1"] == q["eval/pass@1"], r["step"]
    assert r["eval/num_samples"] == q["eval/num_samples"] == 4
  # 3 evaluations x (1 pass@1 + 1 pass@k request) generate calls, counted on both paths.
  assert _host(engines, 6)["eval_calls"] == _host(trainer, 6)["eval_calls"] == 6
  # Resume from checkpoint 4: the step-6 evaluation (temperature-1 pass@k samples too) is the
  # uninterrupted run's, since its noise follows the restored eval counter.
  resumed = str(tmp_path / "resumed")
  shutil.copytree(engines, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  out = run_launch(resumed, *on_engines)
  assert "resumed at step 4" in out.stderr
  got = read_rows(resumed)
  assert [r["step"] for r in got] == list(range(7))
  assert [comparable(r) for r in got] == [comparable(r) for r in rows]


def test_async_engines_eval_splits_the_problems_over_the_pool(tmp_path):
  """Async schedule, 2 JAX rollout workers: the step-0 evaluation starts the pool, every evaluation
  runs as 2 chunks x (pass@1, pass@k) jobs on the pool's runners while the trainer waits."""
  workdir = str(tmp_path / "async")
  run_launch(workdir, *GREEDY, "--config.eval.backend=engines", "--config.scheduler.kind=async",
             "--config.rollout.num_workers=2")
  rows = read_rows(workdir)
  evals = [r for r in rows if "eval/pass@1" in r]
  assert [r["step"] for r in evals] == [0, 3, 6]
  assert all(r["eval/num_problems"] == 16 and 0.0 <= r["eval/pass@1"] <= 1.0 for r in evals)
  assert all(np.isfinite(r["eval/entropy"]) for r in evals)
  assert _host(workdir, 6)["eval_calls"] == 3 * 2 * 2  # evaluations x kinds x chunks


class _Recording:
  """A rollout worker proxy that records each generate call: (version, temperature, n, prompts,
  sampling seed, generated tokens)."""

  def __init__(self, worker, calls):
    self._worker, self._calls = worker, calls

  @property
  def policy_version(self):
    return self._worker.policy_version

  def generate(self, prompts, n, sampling):
    groups = self._worker.generate(prompts, n, sampling)
    tokens = sum(len(c.tokens) for g in groups for c in g.completions)
    self._calls.append((self._worker.policy_version, sampling.temperature, n, len(prompts),
                        sampling.seed, tokens))
    return groups

  def __getattr__(self, name):  # load_weights, close, kill, ping
    return getattr(self._worker, name)


def test_vllm_eval_runs_on_the_engine_and_matches_the_jax_sampler(tmp_path, monkeypatch):
  require("vllm")
  import importlib.util  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import build as build_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import evaluation  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import backends as workers  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(REPO, "configs",
                                                                          "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  c = tiny.get_config()
  c.total_steps, c.trainer.warmup_steps = 2, 1
  c.rollout.backend = "vllm"  # eval.backend stays "auto": the engines
  c.rollout.group_size, c.rollout.prompts_per_request = 4, 4
  c.buffer.size, c.buffer.batch_size = 128, 32
  c.eval.every, c.eval.num_problems, c.eval.n_samples, c.eval.ks = 2, 16, 4, (1, 2, 4)
  c.eval.temperature_pass1 = 0.0
  c.checkpoint.every = 2
  calls, engines, parts_seen = [], [], []
  make_worker, build = workers.RolloutBackend.make_worker, build_lib.build

  def recording_worker(self, index, weights):
    engines.append(make_worker(self, index, weights))
    return _Recording(engines[-1], calls)

  def recording_build(*args):
    parts_seen.append(build(*args))
    return parts_seen[-1]

  monkeypatch.setattr(workers.RolloutBackend, "make_worker", recording_worker)
  monkeypatch.setattr(build_lib, "build", recording_build)
  workdir = str(tmp_path / "vllm")
  pipeline_lib.run(c, workdir)

  parts = parts_seen[0]
  assert parts.config.eval.backend == "engines" and parts.generation.eval_sampler is None  # no trainer KV cache
  assert c.eval.backend == "auto"  # the caller's config is not mutated (the run resolved a copy)
  assert len(engines) == 1 and type(engines[0]).__name__ == "VllmWorkerProcess"
  eval_seeds = (c.seed + 7919, c.seed + 7920)
  evals = [k for k in calls if k[4] in eval_seeds]
  # Two evaluations (step 0, step 2), each a greedy pass@1 request (n_pass1=4) and a pass@k one,
  # over all 16 problems, at the evaluated step's weights.
  assert [(k[0], k[1], k[2], k[3]) for k in evals] == [
      (0, 0.0, 4, 16), (0, 1.0, 4, 16), (2, 0.0, 4, 16), (2, 1.0, 4, 16)]
  assert any(k[4] == c.seed for k in calls)  # the rollouts went through the same engine
  rows = read_rows(workdir)
  assert [r["step"] for r in rows if "eval/pass@1" in r] == [0, 2]

  # The same greedy pass@1 from the trainer's JAX sampler on the same weights.
  task = build_lib.make_task(c.task)
  codec, _ = build_lib.load_codec(c, task, workdir)
  problems = task.eval_set(c.eval.num_problems)
  for step, hf_dir in ((0, c.model.path), (2, os.path.join(workdir, "hf"))):
    sampler = JaxSampler.from_hf(hf_dir, c.model.max_len, batch_size=c.rollout.sampler_batch_size,
                                 eos_token_ids=codec.stop_ids)
    want = evaluation.evaluate(sampler.generate, task, problems, codec, n_samples=0,
                               temperature_pass1=0.0, n_pass1=4, max_tokens=c.rollout.max_tokens,
                               seed=c.seed + 7919)
    [row] = [r for r in rows if r["step"] == step]
    assert row["eval/pass@1"] == want["eval/pass@1"], step
  task.close()
  assert np.isfinite(rows[-1]["eval/entropy"])
