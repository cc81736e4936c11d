"""Where JAX will run and on how many devices, decided before it starts."""
import pytest

from jaxreplay.config import defaults
from jaxreplay.config import platform


def test_cpu_machine():
  c = defaults.base_config()
  c.trainer.num_devices = 3
  env = {}
  p = platform.prepare(c, environ=env, visible=(), tpu_installed=False)
  assert (p.kind, p.devices, p.emulated) == ("cpu", 1, False) and env["JAX_PLATFORMS"] == "cpu"
  env = {"JAX_PLATFORMS": "cpu"}
  p = platform.prepare(c, dry_run=True, environ=env, visible=())  # a GPU config planned on CPU
  assert (p.devices, p.emulated) == (3, True)
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
  assert p.describe() == "3 CPU devices (emulated for the dry run)"
  assert platform.planned_mesh(c, p, dry_run=True).shape == {"data": 1, "fsdp": 3, "tensor": 1}
  env = {"JAX_PLATFORMS": "cpu"}  # --compile_for: the target's compile-only GPUs, no host devices
  p = platform.prepare(c, dry_run=True, environ=env, visible=(), compile_for="h100")
  assert (p.devices, p.emulated, p.compile_for) == (3, False, "h100") and "XLA_FLAGS" not in env
  assert p.describe() == "3 h100 GPUs (compile-only, no GPU here)"
  assert platform.planned_mesh(c, p).shape == {"data": 1, "fsdp": 3, "tensor": 1}


def test_gpu_machine_too_few_gpus():
  c = defaults.base_config()
  c.trainer.num_devices = 3
  c.rollout.backend = "vllm"
  c.rollout.num_workers = 2
  with pytest.raises(platform.PlatformError, match="need 2 worker GPUs but 1 are left"):
    platform.prepare(c, environ={}, visible=("0", "1", "2", "3"), dry_run=False)
  env = {}
  p = platform.prepare(c, environ=env, visible=("0", "1", "2", "3", "4"))
  assert (p.kind, p.devices, p.split.trainer) == ("gpu", 3, ("0", "1", "2"))
  assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2" and "JAX_PLATFORMS" not in env


def test_mesh_shape_fits_the_devices_or_names_the_fix():
  assert platform.mesh_shape((1, -1, 1), 8) == {"data": 1, "fsdp": 8, "tensor": 1}
  assert platform.mesh_shape((2, 2, 2), 8) == {"data": 2, "fsdp": 2, "tensor": 2}
  with pytest.raises(platform.PlatformError,
                     match=r"needs a multiple of 2 devices but the trainer has 1; .*"
                           r"XLA_FLAGS=--xla_force_host_platform_device_count=2"):
    platform.mesh_shape((2, -1, 1), 1)
  with pytest.raises(platform.PlatformError, match="at most one -1"):
    platform.mesh_shape((-1, -1, 1), 4)
  c = defaults.base_config()
  c.trainer.num_devices = 4
  with pytest.raises(platform.PlatformError, match="trainer.num_devices=4 but JAX will see 2"):
    platform.planned_mesh(c, platform.Platform("cpu", 2), dry_run=True)
