"""`run.gpu_compile`: the tiny config's programs compiled for an 8-GPU H100 node without a GPU
(JAX's CUDA plugin: the `gpu-compile` extra, installed by .ci/run), checked against the analytic
plan, and `--dry_run --compile_for` end to end."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.helpers.deps import require
from jaxreplay.config import gpu_targets
from jaxreplay.config import host_devices
from jaxreplay.config import memory_plan
from jaxreplay.run import gpu_compile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIB = 2 ** 30


def _tiny(**overrides):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.trainer.num_devices = 8
  c.rollout.backend = "jax"
  for key, value in overrides.items():
    section, field = key.split("__")
    c[section][field] = value
  return c


@pytest.fixture(scope="module")
def h100():
  require("jax_plugins.xla_cuda13")
  target = gpu_targets.load("h100")
  return target, gpu_compile.compile_devices(target)


def test_tiny_train_step_for_eight_h100s(h100):
  """The train step compiles for sm_90 over an 8-way fsdp mesh: every donated byte reused, no host
  transfer inside, the params gathered and the gradients reduced over the 8 devices, FLOPs near
  the model's count; XLA's arguments are the plan's params + optimizer state + the batch, to the
  byte, the donated state all reused. (The tiny model's temporaries are not the plan's: its
  weights are smaller than its activations, so XLA gathers the batch instead of the weights; the
  four GPU configs' are, in tests/config/test_memory_plan.py against
  bench/results/gpu_compile.json.)"""
  target, devices = h100
  assert len(devices) == 8 and {d.platform for d in devices} == {"gpu"}
  assert devices[0].device_kind == target.description
  c = _tiny()
  mesh = memory_plan.planned_mesh(c, devices)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  step = next(p for p in gpu_compile.programs(c, mesh) if p.name == "train_step")
  rec, hlo = gpu_compile.compile_program(step)
  assert rec["donation"]["all_used"] and rec["donation"]["unusable"] == []
  assert rec["alias_bytes"] == rec["donation"]["donated_bytes"] > 0
  assert rec["host_transfers"] == []
  assert rec["peak_bytes"] == (rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"]
                               + rec["temp_bytes"] + rec["resident_bytes"])
  time_rec = gpu_compile.step_time(hlo, c, gpu_compile.target_model_config(c), target)
  kinds = time_rec["collectives"]
  assert kinds["all-gather"]["group_sizes"] == [8] and kinds["all-gather"]["count"] > 0
  assert any(k in kinds for k in ("all-reduce", "reduce-scatter"))
  assert time_rec["trip_counts_known"] and time_rec["flops_source"].startswith("hlo")
  assert 0.5 < time_rec["step_flops_per_device"] / time_rec["model_flops_per_device"] < 1.5
  plan = memory_plan.plan(c, devices, device_memory=int(0.9 * target.memory_bytes))
  parts = plan["per_device_bytes"]
  batch = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
              for x in jax.tree.leaves(step.args[1]))
  state = parts["params"] + parts["opt_state"] + 4 + 8  # + the step (int32), the rng (uint32 [2])
  assert rec["alias_bytes"] == state
  # + the batch fields the step reads (jit drops the unused rewards and policy_version, 2 x 32 B)
  assert rec["argument_bytes"] == state + batch - 2 * 8 * 4
  assert rec["output_bytes"] >= rec["alias_bytes"] and rec["temp_bytes"] > 0
  assert rec["peak_bytes"] < 0.01 * target.memory_bytes  # fits, by far


def test_the_gradient_gates_step_compiles_with_its_bound(h100):
  """buffer.reuse_control="gradient_gate": the train step compiled is the gated one (the bound a
  replicated float32 scalar argument), its donation used as the ungated step's."""
  _, devices = h100
  c = _tiny(buffer__on_policy=True, buffer__reuse_control="gradient_gate")
  mesh = memory_plan.planned_mesh(c, devices)
  step = next(p for p in gpu_compile.programs(c, mesh) if p.name == "train_step")
  assert len(step.args) == 3 and step.args[2].shape == () and step.args[2].dtype == jnp.float32
  rec, _ = gpu_compile.compile_program(step)
  assert rec["donation"]["all_used"] and rec["host_transfers"] == []


def test_every_program_of_a_bf16_jax_sampler_run(h100):
  """A bfloat16 run sampling on the trainer (cuDNN attention, the JAX sampler's prefill + decode,
  LoRA with a KL reference): every program compiles, none moves data to the host."""
  require("nvidia.cudnn")
  target, devices = h100
  c = _tiny(model__dtype="bfloat16", model__lora_rank=4, trainer__kl_coef=0.01,
            eval__backend="trainer", trainer__pack=True)
  assert gpu_compile.target_model_config(c).attention == "cudnn"
  records, time_rec, _ = gpu_compile.compile_all(c, target)
  assert set(records) == {"train_step", "logprob_fn", "diagnostics", "update_kl_probe",
                          "publish", "export_check", "sampler", "eval_sampler"}
  for name, rec in records.items():
    assert rec["host_transfers"] == [], name
    assert set(gpu_compile.MEMORY_KEYS) <= set(rec), name
  assert records["train_step"]["donation"]["all_used"]
  assert time_rec["hlo_flops"]["attention"] > 0  # cuDNN flash attention, forward and backward


def test_without_the_plugin_one_line_names_the_install(monkeypatch):
  monkeypatch.setattr(host_devices, "cuda_plugin_installed", lambda: False)
  with pytest.raises(gpu_compile.PluginMissing) as e:
    gpu_compile.check_plugin()
  assert str(e.value).count("\n") == 0 and gpu_compile.PLUGIN_INSTALL in str(e.value)
  monkeypatch.setattr(host_devices, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(host_devices, "installed", lambda module: module != "nvidia.cudnn")
  with pytest.raises(gpu_compile.PluginMissing, match="cuDNN"):
    gpu_compile.check_plugin(need_cudnn=True)


def _launch(tmp_path, *extra, env=None):
  cmd = [sys.executable, "-m", "jaxreplay.launch", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.trainer.num_devices=8", *extra]
  env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_compile_for_writes_the_compiled_plan(tmp_path):
  require("jax_plugins.xla_cuda13")
  # (the diagnostics and the evaluation sampler: in the bf16 test above; not compiled again here)
  out = _launch(tmp_path, "--dry_run", "--compile_for=h100", "--config.rollout.backend=jax",
                "--config.log.diagnostics_every=0", "--config.eval.num_problems=0")
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.load(open(tmp_path / "plan.json"))
  assert plan["target"]["name"] == "h100" and plan["devices"]["platform"] == "gpu"
  assert set(plan["compiled"]) == set(plan["programs"]) == {
      "train_step", "logprob_fn", "publish", "export_check", "sampler"}
  for rec in plan["compiled"].values():
    assert set(gpu_compile.MEMORY_KEYS) <= set(rec)
  assert plan["peak"]["xla_bytes"] == max(r["peak_bytes"] for r in plan["compiled"].values())
  assert plan["fits"] is True and plan["device_memory_bytes"] == int(
      0.9 * gpu_targets.load("h100").memory_bytes)
  assert {"compute_s", "comm_s", "collectives", "flops_source"} <= set(plan["time"])
  assert "compiled for h100" in out.stdout and "XLA" in out.stdout
  assert not [line for line in out.stderr.splitlines() if "Traceback" in line]
  # The same plan on a device too small for it: the check names XLA's largest program and its keys
  # (the launcher turns DoesNotFit into exit 3: tests/config/test_memory_plan.py).
  plan["device_memory_bytes"], plan["fits"] = plan["peak"]["xla_bytes"] - 1, None
  memory_plan.with_compiled_fit(plan)
  name = plan["peak"]["xla_program"]
  with pytest.raises(memory_plan.DoesNotFit, match=rf"^{name} needs .* by XLA's count .*"
                     + re.escape(memory_plan.PROGRAM_FIXES[name])):
    memory_plan.check_fits(plan)


def test_compile_for_bad_target_and_missing_plugin_are_one_line(tmp_path):
  bad = _launch(tmp_path, "--dry_run", "--compile_for=a100")
  assert bad.returncode == 2 and "h100" in bad.stderr and "h200" in bad.stderr, bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
  assert not (tmp_path / "plan.json").exists()
  code = ("import sys; from jaxreplay.config import host_devices; "
          "host_devices.cuda_plugin_installed = lambda: False; "
          "from absl import app; from jaxreplay import launch; "
          f"sys.argv = ['launch', '--config=configs/tiny.py', '--workdir={tmp_path}', "
          "'--compile_for=h100']; app.run(launch.main, flags_parser=launch.parse_flags)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert out.returncode == 2 and out.stderr.strip().splitlines() == [
      "error: --compile_for=h100 needs JAX's CUDA plugin (no GPU needed); pip install -e "
      "'.[gpu-compile]'"], out.stderr
  assert not os.listdir(tmp_path)
