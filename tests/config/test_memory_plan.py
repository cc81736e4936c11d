"""`--dry_run`'s memory plan, on 8 emulated CPU devices (see conftest.py); the GPU split:
tests/config/test_devices.py."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from ml_collections import config_flags  # noqa: F401  (the configs import ml_collections)

from jaxreplay.learner import batch as batch_lib
from jaxreplay.config import memory_plan
from jaxreplay.learner import optim
from jaxreplay.infra import sharding
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import presets
from tests.helpers.paths import REPO

GPU_CONFIGS = ("qwen3_0_6b", "qwen3_8b", "qwen2_5_7b", "llama3_2_3b")
SPLITS = ((5, 3), (6, 2), (4, 4))  # the paper's (W, T) on one 8-GPU node
H200_GIB = 141.0


def _config(name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("name", GPU_CONFIGS)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"W{s[0]}T{s[1]}")
def test_gpu_configs_fit_one_h200_node_at_the_papers_splits(name, split):
  c = _config(name)
  c.rollout.num_workers, c.trainer.num_devices = split
  c.devices.memory_gib = H200_GIB
  p = memory_plan.plan(c)
  t = split[1]
  assert p["devices"]["mesh"] == {"data": 1, "fsdp": t, "tensor": 1}
  # Each device holds ~1/T of the parameters: nothing replicated (padding adds < 0.1%).
  assert abs(p["params_fraction_per_device"] - 1 / t) < 0.01 / t, p["params_fraction_per_device"]
  per = p["per_device_bytes"]
  assert per["opt_state"] == pytest.approx(2 * per["params"], rel=1e-3)  # Adam's mu and nu in f32
  assert set(per) >= {"params", "opt_state", "grads", "activations", "total"}
  assert per["total"] == sum(v for k, v in per.items() if k != "total")
  assert p["fits"], memory_plan.format_plan(p)


def test_plan_does_not_fit_a_small_device():
  c = _config("qwen3_8b")
  c.devices.memory_gib = 40.0
  p = memory_plan.plan(c)
  assert p["fits"] is False
  with pytest.raises(memory_plan.DoesNotFit, match="GiB per trainer device"):
    memory_plan.check_fits(p)


def test_batch_rule_names_valid_values():
  c = _config("qwen3_8b")
  c.trainer.num_microbatches = 15  # B=60 over 3 devices is 20 rows: 15 does not divide it
  with pytest.raises(ValueError, match=r"1, 2, 4, 5, 10, 20"):
    memory_plan.plan(c)
  # ppo_minibatches: each minibatch of B/m rows obeys the rule too (60 / 4 = 15 rows, 3 devices x 2)
  c.trainer.num_microbatches, c.trainer.ppo_minibatches = 2, 4
  errors = memory_plan.batch_rule_errors(c, sharding.make_mesh((1, 3, 1), devices=jax.devices()[:3]))
  assert len(errors) == 1 and "trainer.ppo_minibatches=4" in errors[0] and "B/m = 15" in errors[0]


def test_activation_estimate_against_xla():
  """The plan's activations + grads against XLA's compiled temp bytes of the real train step."""
  for remat in (False, True):
    cfg = presets.qwen3_0_6b(num_hidden_layers=2, vocab_size=4096, hidden_size=512,
                             intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                             remat=remat)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    opt = optim.make_optimizer(1e-5)
    state = jax.eval_shape(lambda: trainer.init_train_state(cfg, opt, jax.random.PRNGKey(0),
                                                            mesh=mesh))
    step = trainer.make_train_step(cfg, opt, loss_fn_lib.make_loss_fn("grpo"), mesh,
                                   trainer.state_shardings(state, mesh), chunk_size=128)
    rows, seq = 2, 512
    spec = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt)
    batch = batch_lib.Batch(
        tokens=spec(np.int32, rows, seq), positions=spec(np.int32, rows, seq),
        segment_ids=spec(np.int32, rows, seq), targets=spec(np.int32, rows, seq),
        completion_mask=spec(np.float32, rows, seq), behaviour_logprobs=spec(np.float32, rows, seq),
        advantages=spec(np.float32, rows), rewards=spec(np.float32, rows),
        policy_version=spec(np.int32, rows))
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    param_bytes = cfg.num_params() * 4
    estimate = memory_plan.activation_bytes(cfg, rows, seq, 128) + 2 * param_bytes
    assert temp / 1.5 <= estimate <= temp * 1.5, (remat, temp, estimate)


def test_dry_run_command_writes_plan_json(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  data = tmp_path / "train.jsonl"  # the dry run checks that the task's file exists
  data.write_text('{"problem": "1+1", "answer": "2"}\n')
  cmd = [sys.executable, "-m", "jaxreplay.launch", "--config=configs/qwen2_5_7b.py",
         f"--workdir={tmp_path}", "--dry_run", f"--config.task.path={data}",
         f"--config.devices.memory_gib={H200_GIB}"]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.load(open(tmp_path / "plan.json"))
  assert plan["devices"]["trainer_devices"] == 3 and plan["fits"]
  assert set(plan["per_device_bytes"]) >= {"params", "opt_state", "grads", "activations", "total"}
  assert "per device" in out.stdout and "fits: True" in out.stdout
  assert not [l for l in out.stderr.splitlines() if "Warning" in l or "WARNING" in l], out.stderr
  small = subprocess.run(cmd[:-1] + ["--config.devices.memory_gib=24"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
  assert small.returncode == 3 and "DoesNotFit" in small.stderr, small.stderr[-2000:]


# ---- the analytic plan against XLA:GPU's compiled programs ---------------------------------------


def _recorded_rows():
  """bench/results/gpu_compile.json: the four GPU configs compiled for H100 and H200."""
  with open(os.path.join(REPO, "bench", "results", "gpu_compile.json")) as f:
    return json.load(f)["rows"]


@pytest.mark.parametrize("row", _recorded_rows(), ids=lambda r: f"{r['config']}-{r['target']}")
def test_analytic_peak_within_ten_percent_of_xla(row):
  """The plan made now (no compile) against XLA's per-device peak recorded by bench/gpu_compile.py
  for the same config and target: within 10%, and each config fits the H100 at
  devices.memory_fraction 0.9 with >= 5% to spare by XLA's count."""
  c = _config(row["config"])
  assert row["overrides"] == []
  from jaxreplay.config import gpu_targets  # pylint: disable=g-import-not-at-top
  target = gpu_targets.load(row["target"])
  p = memory_plan.plan(c, device_memory=int(target.memory_bytes * c.devices.memory_fraction))
  xla = row["xla_peak_bytes"]
  assert abs(p["peak"]["analytic_bytes"] / xla - 1) <= 0.10, (p["programs"], row["xla_peak_bytes"])
  for name, rec in row["plan"]["compiled"].items():  # every program's estimate, within 25%
    assert abs(p["programs"][name] / rec["peak_bytes"] - 1) <= 0.25, (name, p["programs"], rec)
  assert xla <= 0.95 * 0.9 * target.memory_bytes and p["fits"]


def test_diagnostics_splits_are_the_regime_diagnostics():
  from jaxreplay.run import regime  # pylint: disable=g-import-not-at-top
  for rows in (12, 24, 60, 64, 96):
    for multiple in (1, 2, 3, 4, 8):
      for preferred in (2, 4, 5, 8):
        assert memory_plan.diagnostics_splits(rows, multiple, preferred) == regime.splits_for(
            rows, multiple, preferred)


def test_programs_and_the_fit_use_the_largest():
  c = _config("qwen3_8b")
  c.devices.memory_gib = 80.0
  p = memory_plan.plan(c)
  per, progs = p["per_device_bytes"], p["programs"]
  assert set(progs) == {"train_step", "logprob_fn", "diagnostics", "update_kl_probe", "publish",
                        "export_check"}  # vLLM engines sample and evaluate: no sampler here
  assert progs["train_step"] == (per["params"] + per["opt_state"] + per["grads"]
                                 + per["activations"] + 1 * 4608 * 151936 * 4)  # the probe's
  assert progs["export_check"] == per["params"] + per["opt_state"]
  assert progs["publish"] == progs["export_check"] + per["params"] // 2  # bf16 for the engines
  assert p["peak"] == {"analytic_bytes": max(progs.values()), "analytic_program": "train_step"}
  c.devices.memory_gib = 70.0
  with pytest.raises(memory_plan.DoesNotFit, match="train_step needs .*trainer.num_microbatches"):
    memory_plan.check_fits(memory_plan.plan(c))
