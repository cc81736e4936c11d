"""Where a run's JAX will run and on how many devices, decided before JAX starts.

`prepare(config, dry_run, compile_for)` sets this process's environment for JAX and returns a
`Platform`:

  GPU machine   `devices.apply_to_environment`: the trainer's GPUs (CUDA_VISIBLE_DEVICES), the
                workers' (JAXREPLAY_WORKER_GPUS); too few GPUs for trainer.num_devices plus the
                workers is an error naming the key to change
  CPU machine   `host_devices.cpu_environment`: JAX_PLATFORMS=cpu unless set (no TPU / CUDA
                probe, none of its log lines); the JAX devices are XLA's host devices
                (`--xla_force_host_platform_device_count` in XLA_FLAGS, else 1). A --dry_run of a
                config for T > 1 trainer devices emulates T host devices itself (XLA_FLAGS gets
                the count), so a GPU config plans on a laptop; a real CPU run trains on every host
                device (trainer.num_devices counts in the accounting only) and must fit
                trainer.mesh_shape onto them
  --compile_for the trainer's T devices are compile-only GPUs of the target (`run.gpu_compile`),
                no host devices emulated

`planned_mesh(config, platform)` then checks the mesh the run will build (trainer.mesh_shape over
the devices JAX will see) and the batch rules on it, without creating a device: a shape that does
not fit names the XLA_FLAGS or key that fixes it. Nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from jaxreplay.config import devices as devices_lib
from jaxreplay.config import host_devices

_COUNT_FLAG = host_devices.COUNT_FLAG
AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class Platform:
  """kind: "gpu" or "cpu"; devices: how many devices the trainer's JAX will see; split: the GPU
  split (GPU machines); emulated: host devices this call asked XLA for (a CPU dry run);
  compile_for: the GPU target whose compile-only devices the trainer's programs are built for."""
  kind: str
  devices: int
  split: Optional[devices_lib.GpuSplit] = None
  emulated: bool = False
  compile_for: Optional[str] = None

  def describe(self) -> str:
    s = "s" if self.devices != 1 else ""
    if self.kind == "gpu":
      return f"{self.devices} GPU{s} ({','.join(self.split.trainer)})"
    if self.compile_for:
      return f"{self.devices} {self.compile_for} GPU{s} (compile-only, no GPU here)"
    return (f"{self.devices} CPU device{s}"
            + (" (emulated for the dry run)" if self.emulated else ""))


class PlatformError(ValueError):
  """The machine cannot run the config as set (one line naming the fix)."""


def prepare(config, dry_run: bool = False, environ=None, visible=None,
            compile_for: Optional[str] = None, tpu_installed: Optional[bool] = None) -> Platform:
  """Sets the environment for the trainer's JAX (see the module docstring); `PlatformError` when
  this machine's devices cannot hold the config. `visible` replaces the probed GPUs,
  `tpu_installed` the libtpu lookup (tests)."""
  env = os.environ if environ is None else environ
  try:
    split = devices_lib.apply_to_environment(config, env, visible=visible)
  except (ValueError, RuntimeError) as e:
    raise PlatformError(str(e)) from None
  if split is not None:
    return Platform("gpu", len(split.trainer), split)
  t = int(config.trainer.num_devices)
  emulate = t if dry_run and not compile_for else 0
  changed = host_devices.cpu_environment(env, dry_run_devices=emulate, tpu_installed=tpu_installed)
  if compile_for:
    return Platform("cpu", t, compile_for=compile_for)
  return Platform("cpu", host_devices.host_device_count(env), emulated="XLA_FLAGS" in changed)


def mesh_shape(shape, n: int) -> dict[str, int]:
  """trainer.mesh_shape over `n` devices ({axis: size}, the -1 entry resolved), as
  `infra.sharding.make_mesh` builds it; `PlatformError` naming the fix when it does not fit."""
  shape = [int(s) for s in shape]
  if len(shape) != len(AXES) or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise PlatformError(f"trainer.mesh_shape={tuple(shape)}: expected 3 entries (data, fsdp, "
                        "tensor), positive, with at most one -1; e.g. (1, -1, 1)")
  known = math.prod(s for s in shape if s != -1)
  if (n % known if -1 in shape else known != n):
    raise PlatformError(
        f"trainer.mesh_shape={tuple(shape)} needs {'a multiple of ' if -1 in shape else ''}{known} "
        f"devices but the trainer has {n}; set trainer.mesh_shape=(1, -1, 1), or on CPU emulate "
        f"{known} devices with XLA_FLAGS={_COUNT_FLAG}={known}")
  if -1 in shape:
    shape[shape.index(-1)] = n // known
  return dict(zip(AXES, shape))


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """The planned mesh's shape, read as `memory_plan.batch_rule_errors` reads a Mesh."""
  shape: dict
  size: int


def planned_mesh(config, platform: Platform, dry_run: bool = False) -> MeshShape:
  """The trainer's mesh shape on `platform`: trainer.mesh_shape over its devices (a dry run, and
  a GPU run, over trainer.num_devices of them)."""
  t = int(config.trainer.num_devices)
  dry_run = dry_run or platform.compile_for is not None
  if (dry_run or platform.kind == "gpu") and platform.devices < t:
    raise PlatformError(f"trainer.num_devices={t} but JAX will see {platform.devices} devices; "
                        f"lower trainer.num_devices, or on CPU emulate them with "
                        f"XLA_FLAGS={_COUNT_FLAG}={t}")
  n = t if dry_run or platform.kind == "gpu" else platform.devices
  shape = mesh_shape(config.trainer.mesh_shape, n)
  return MeshShape(shape, math.prod(shape.values()))
