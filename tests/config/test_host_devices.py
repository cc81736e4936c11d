"""The environment a launch without GPUs sets before JAX starts (`config.host_devices`)."""
import os
import subprocess
import sys

from jaxreplay.config import host_devices

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
COUNT = "--xla_force_host_platform_device_count"


def test_without_a_gpu_jax_runs_on_the_cpu():
  env = {}
  assert host_devices.cpu_environment(env, tpu_installed=False) == {"JAX_PLATFORMS": "cpu"}
  assert env == {"JAX_PLATFORMS": "cpu"}
  env = {"JAX_PLATFORMS": "cuda"}  # the user's choice stands
  assert host_devices.cpu_environment(env, tpu_installed=False) == {}
  assert host_devices.cpu_environment({}, tpu_installed=True) == {}  # a TPU machine
  env = {}
  assert host_devices.cpu_environment(env, gpus_visible=True, tpu_installed=False,
                                      dry_run_devices=3) == {} and env == {}


def test_host_device_count():
  assert host_devices.host_device_count({}) == 1
  assert host_devices.host_device_count({"XLA_FLAGS": f"--xla_dump_to=/tmp/d {COUNT}=2"}) == 2
  assert host_devices.host_device_count({"XLA_FLAGS": f"{COUNT}=2 {COUNT}=5"}) == 5  # XLA's last


def test_a_cpu_dry_run_gets_its_trainer_devices():
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "JAX_PLATFORMS": "cpu"}
  host_devices.cpu_environment(env, dry_run_devices=3, tpu_installed=False)
  assert env["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {COUNT}=3"
  env = {"XLA_FLAGS": f"{COUNT}=8", "JAX_PLATFORMS": "cpu"}  # a count already enough is kept
  assert host_devices.cpu_environment(env, dry_run_devices=3, tpu_installed=False) == {}
  env = {"XLA_FLAGS": f"--xla_dump_to=/tmp/d {COUNT}=2", "JAX_PLATFORMS": "cpu"}  # too few: raised
  assert host_devices.cpu_environment(env, dry_run_devices=3, tpu_installed=False) == {
      "XLA_FLAGS": f"--xla_dump_to=/tmp/d {COUNT}=3"}
  env = {"JAX_PLATFORMS": "cpu"}
  assert host_devices.cpu_environment(env, dry_run_devices=1, tpu_installed=False) == {}


def test_cpu_dry_run_of_a_three_device_config_needs_no_flag(tmp_path):
  """`--dry_run` of a T=3 config in a fresh process without XLA_FLAGS: the launcher sets them."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = ROOT
  out = subprocess.run(
      [sys.executable, "-m", "jaxreplay.launch", "--config=configs/qwen3_0_6b.py",
       f"--workdir={tmp_path}", "--dry_run", "--config.task.path=assets/math_example.jsonl",
       "--config.devices.memory_gib=80"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "T=3 cpu devices" in out.stdout
  assert "Traceback" not in out.stderr and "cuPTI" not in out.stderr
