"""Where a run's JAX will run and on how many devices, decided before JAX starts.

`prepare(config, dry_run)` sets this process's environment for JAX and returns a `Platform`:

  GPU machine   `devices.apply_to_environment`: the trainer's GPUs (CUDA_VISIBLE_DEVICES), the
                workers' (JAXREPLAY_WORKER_GPUS); too few GPUs for trainer.num_devices plus the
                workers is an error naming the key to change
  CPU machine   JAX_PLATFORMS=cpu unless set (no TPU / CUDA probe, none of its log lines); the JAX
                devices are XLA's host devices (`--xla_force_host_platform_device_count` in
                XLA_FLAGS, else 1). A --dry_run of a config for T > 1 trainer devices emulates T
                host devices itself (XLA_FLAGS gets the count), so a GPU config plans on a laptop;
                a real CPU run trains on every host device (trainer.num_devices counts in the
                accounting only) and must fit trainer.mesh_shape onto them

`mesh_errors(config, platform)` then checks the mesh the run will build (trainer.mesh_shape over
the devices JAX will see) and the batch rules on it, without creating a device: a shape that does
not fit names the XLA_FLAGS or key that fixes it. Nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional

from jaxreplay.config import devices as devices_lib

_COUNT_FLAG = "--xla_force_host_platform_device_count"
_COUNT = re.compile(re.escape(_COUNT_FLAG) + r"=(\d+)")
AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class Platform:
  """kind: "gpu" or "cpu"; devices: how many devices the trainer's JAX will see; split: the GPU
  split (GPU machines); emulated: host devices this call asked XLA for (a CPU dry run)."""
  kind: str
  devices: int
  split: Optional[devices_lib.GpuSplit] = None
  emulated: bool = False

  def describe(self) -> str:
    if self.kind == "gpu":
      return (f"{self.devices} GPU{'s' if self.devices != 1 else ''} "
              f"({','.join(self.split.trainer)})")
    return (f"{self.devices} CPU device{'s' if self.devices != 1 else ''}"
            + (" (emulated for the dry run)" if self.emulated else ""))


class PlatformError(ValueError):
  """The machine cannot run the config as set (one line naming the fix)."""


def host_device_count(environ=None) -> int:
  """XLA's host devices under `environ`'s XLA_FLAGS (1 when unset)."""
  env = os.environ if environ is None else environ
  found = _COUNT.findall(env.get("XLA_FLAGS", ""))
  return int(found[-1]) if found else 1


def emulate_host_devices(n: int, environ=None) -> None:
  """Asks XLA for `n` host devices (XLA_FLAGS' count replaced or added)."""
  env = os.environ if environ is None else environ
  flags = _COUNT.sub("", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join(flags + [f"{_COUNT_FLAG}={n}"])


def cpu_only(environ=None, gpus=None) -> bool:
  """On a machine without a GPU (`gpus`: the visible ones, probed when None) or TPU, sets
  JAX_PLATFORMS=cpu unless it is set (JAX then probes no other backend, and logs no failed probe).
  Returns whether JAX will run on the CPU."""
  env = os.environ if environ is None else environ
  gpus = devices_lib.visible_gpus(env) if gpus is None else gpus
  if gpus or importlib.util.find_spec("libtpu") is not None:
    return env.get("JAX_PLATFORMS", "") == "cpu"
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env["JAX_PLATFORMS"] == "cpu"


def prepare(config, dry_run: bool = False, environ=None, visible=None) -> Platform:
  """Sets the environment for the trainer's JAX (see the module docstring); `PlatformError` when
  this machine's devices cannot hold the config. `visible` replaces the probed GPUs (tests)."""
  env = os.environ if environ is None else environ
  try:
    split = devices_lib.apply_to_environment(config, env, visible=visible)
  except (ValueError, RuntimeError) as e:
    raise PlatformError(str(e)) from None
  if split is not None:
    return Platform("gpu", len(split.trainer), split)
  cpu_only(env, gpus=())
  t = int(config.trainer.num_devices)
  if dry_run and host_device_count(env) < t:
    emulate_host_devices(t, env)
    return Platform("cpu", t, emulated=True)
  return Platform("cpu", host_device_count(env))


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
  if (dry_run or platform.kind == "gpu") and platform.devices < t:
    raise PlatformError(f"trainer.num_devices={t} but JAX will see {platform.devices} devices; "
                        f"lower trainer.num_devices, or on CPU emulate them with "
                        f"XLA_FLAGS={_COUNT_FLAG}={t}")
  n = t if dry_run or platform.kind == "gpu" else platform.devices
  shape = mesh_shape(config.trainer.mesh_shape, n)
  return MeshShape(shape, math.prod(shape.values()))
