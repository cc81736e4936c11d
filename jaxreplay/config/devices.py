"""Which GPUs the trainer gets and which the rollout workers get: one config section, `devices`.

On one node, the trainer process (JAX) must see only its T GPUs and each vLLM worker its own; both
`python -m jaxreplay.launch` and `launch/single_host.sh` go through `split_gpus`, and
`apply_to_environment` sets CUDA_VISIBLE_DEVICES (the trainer) and JAXREPLAY_WORKER_GPUS (the
workers, read by `workers.RolloutBackend`) before JAX is imported.

  devices.trainer  "0,1,2": the trainer's GPU ids; "" = the first trainer.num_devices visible GPUs
  devices.workers  "3,4,5,6,7": the workers' GPU ids; "" = the visible GPUs after the trainer's
  devices.memory_gib        one trainer device's memory for --dry_run's fit check [GiB]; 0 = the
                            device's own (GPU) or no check (CPU)
  devices.memory_fraction   the share of it JAX may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION)

This module imports no JAX (it runs before JAX picks its devices).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class GpuSplit:
  """trainer: GPU ids of the trainer process (T of them); workers: GPU ids of the rollout workers,
  `per_worker` consecutive ids each (a vLLM engine's tensor-parallel size)."""
  trainer: tuple[str, ...]
  workers: tuple[str, ...]
  per_worker: int = 1

  def worker_gpus(self, index: int) -> tuple[str, ...]:
    """The GPU ids of rollout worker `index`."""
    n = len(self.workers) // self.per_worker
    i = index % max(n, 1)
    return self.workers[i * self.per_worker:(i + 1) * self.per_worker]


def parse_ids(text: str, key: str) -> tuple[str, ...]:
  ids = tuple(s.strip() for s in str(text).split(",") if s.strip())
  bad = [i for i in ids if not re.fullmatch(r"\d+|GPU-[0-9a-fA-F-]+", i)]
  if bad:
    raise ValueError(f"{key}={text!r}: expected comma-separated GPU indices such as '0,1,2' "
                     f"(bad entries: {bad})")
  if len(set(ids)) != len(ids):
    raise ValueError(f"{key}={text!r} names a GPU twice")
  return ids


def visible_gpus(environ: Optional[dict] = None) -> tuple[str, ...]:
  """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else /dev/nvidiaN devices."""
  env = os.environ if environ is None else environ
  if "CUDA_VISIBLE_DEVICES" in env:
    return parse_ids(env["CUDA_VISIBLE_DEVICES"], "CUDA_VISIBLE_DEVICES")
  found = [m.group(1) for p in glob.glob("/dev/nvidia*") if (m := re.fullmatch(r"/dev/nvidia(\d+)", p))]
  return tuple(sorted(found, key=int))


def split_gpus(config, gpus: Sequence[str]) -> GpuSplit:
  """The trainer / worker split of `gpus` chosen by `config.devices` (see the module docstring).

  Raises ValueError naming the keys to change when the split does not match trainer.num_devices
  (T), rollout.num_workers (W) and the engines' tensor-parallel size, or names an absent GPU.
  """
  c = config
  gpus = tuple(str(g) for g in gpus)
  t = int(c.trainer.num_devices)
  tp = int(getattr(c.rollout, "vllm_tensor_parallel_size", 1) or 1)
  trainer = parse_ids(c.devices.trainer, "devices.trainer")
  workers = parse_ids(c.devices.workers, "devices.workers")
  if trainer and len(trainer) != t:
    raise ValueError(f"devices.trainer={c.devices.trainer!r} holds {len(trainer)} GPUs but "
                     f"trainer.num_devices={t}; set --config.trainer.num_devices={len(trainer)}")
  if not trainer:
    if len(gpus) < t:
      raise ValueError(f"trainer.num_devices={t} but only {len(gpus)} GPUs are visible "
                       f"({','.join(gpus) or 'none'}); lower trainer.num_devices")
    trainer = gpus[:t]
  if not workers:
    workers = tuple(g for g in gpus if g not in trainer)
  missing = [g for g in trainer + workers if g not in gpus]
  if missing:
    raise ValueError(f"GPUs {missing} of devices.trainer / devices.workers are not visible "
                     f"(visible: {','.join(gpus) or 'none'})")
  shared = sorted(set(trainer) & set(workers))
  if shared:
    raise ValueError(f"GPUs {shared} are in both devices.trainer and devices.workers; give the "
                     "trainer and the vLLM engines separate GPUs (or set rollout.backend=jax)")
  if c.rollout.backend == "vllm":
    need = int(c.rollout.num_workers) * tp
    if len(workers) < need:
      raise ValueError(
          f"rollout.num_workers={c.rollout.num_workers} vLLM engines x tensor-parallel {tp} need "
          f"{need} worker GPUs but {len(workers)} are left ({','.join(workers) or 'none'}) after "
          f"the trainer's {','.join(trainer)}; lower rollout.num_workers to "
          f"{len(workers) // tp} or trainer.num_devices")
    workers = workers[:need]
  return GpuSplit(trainer=trainer, workers=workers, per_worker=tp)


def apply_to_environment(config, environ: Optional[dict] = None) -> Optional[GpuSplit]:
  """On a GPU machine: restricts this process (the trainer) to its GPUs and hands the workers
  theirs, through the environment; must run before JAX is imported. None on machines without
  GPUs (nothing is changed)."""
  env = os.environ if environ is None else environ
  gpus = visible_gpus(env)
  if not gpus:
    return None
  split = split_gpus(config, gpus)
  env["CUDA_VISIBLE_DEVICES"] = ",".join(split.trainer)
  env["JAXREPLAY_WORKER_GPUS"] = ",".join(split.workers)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(config.devices.memory_fraction))
  return split
