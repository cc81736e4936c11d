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

GPU ids are CUDA's: ordinals in PCI bus order (`apply_to_environment` exports
CUDA_DEVICE_ORDER=PCI_BUS_ID for this process and every process it starts, so the trainer, the
engines and nvidia-smi number the GPUs alike), or GPU-/MIG- uuids. The visible GPUs are
CUDA_VISIBLE_DEVICES when set, else what the CUDA driver enumerates (`cuda_probe`, ctypes on
libcuda in a short subprocess: this process must not initialise CUDA before its
CUDA_VISIBLE_DEVICES is set), else nvidia-smi's count. A container given /dev/nvidia3 and
/dev/nvidia5 sees CUDA devices 0 and 1, which is what these return (never the /dev/nvidiaN numbers).

`check_one_cuda_major` refuses an environment whose colliding NVIDIA libraries (`LIBRARY_PACKAGES`:
cuDNN, NCCL, NVSHMEM, cuBLAS, the CUDA runtime, ...) come in both CUDA 12 and 13 (their wheels
overwrite each other's files: JAX or torch would load the other's build); other `-cu12` packages
(nvidia-cutlass-dsl-libs-cu12, which vLLM's gpu extra pulls in) do not count.

This module imports no JAX (it runs before JAX picks its devices).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Optional, Sequence

from jaxreplay.rollout import backend_table


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


_GPU_ID = re.compile(r"\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9A-Za-z/-]+")


def parse_ids(text: str, key: str) -> tuple[str, ...]:
  """Comma-separated GPU ids: CUDA ordinals, `GPU-<uuid>` or `MIG-<uuid>` (as CUDA_VISIBLE_DEVICES
  takes them)."""
  ids = tuple(s.strip() for s in str(text).split(",") if s.strip())
  bad = [i for i in ids if not _GPU_ID.fullmatch(i)]
  if bad:
    raise ValueError(f"{key}={text!r}: expected comma-separated GPU indices such as '0,1,2' "
                     f"(or GPU-/MIG- uuids; bad entries: {bad})")
  if len(set(ids)) != len(ids):
    raise ValueError(f"{key}={text!r} names a GPU twice")
  return ids


# Run in a subprocess by `cuda_probe`: the CUDA driver's devices (honours CUDA_VISIBLE_DEVICES and
# CUDA_DEVICE_ORDER), as JSON [{"ordinal", "uuid", "pci"}], or {"error": ...}.
_CUDA_PROBE = r"""
import ctypes, json
def probe():
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    return {"error": f"no CUDA driver library: {e}"}
  rc = cuda.cuInit(0)
  if rc == 100:  # CUDA_ERROR_NO_DEVICE
    return []
  if rc != 0:
    return {"error": f"cuInit failed with CUresult {rc}"}
  n = ctypes.c_int()
  if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
    return {"error": "cuDeviceGetCount failed"}
  out = []
  for i in range(n.value):
    dev = ctypes.c_int()
    uuid = (ctypes.c_ubyte * 16)()
    pci = ctypes.create_string_buffer(32)
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    if (cuda.cuDeviceGet(ctypes.byref(dev), i) or get_uuid(uuid, dev)
        or cuda.cuDeviceGetPCIBusId(pci, 32, dev)):
      return {"error": f"querying CUDA device {i} failed"}
    h = bytes(uuid).hex()
    out.append({"ordinal": i, "uuid": f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}",
                "pci": pci.value.decode()})
  return out
print(json.dumps(probe()))
"""


def cuda_probe(environ: Optional[dict] = None, timeout_s: float = 60.0) -> Optional[list[dict]]:
  """The GPUs the CUDA driver enumerates under `environ` (its CUDA_VISIBLE_DEVICES and
  CUDA_DEVICE_ORDER), each {"ordinal", "uuid", "pci"}, found by ctypes on libcuda.so.1 in a short
  subprocess (so this process never initialises CUDA); None when there is no driver or it fails."""
  env = dict(os.environ if environ is None else environ)
  try:
    out = subprocess.run([sys.executable, "-c", _CUDA_PROBE], env=env, capture_output=True,
                         text=True, timeout=timeout_s, check=False)
    found = json.loads(out.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None
  return found if isinstance(found, list) else None


def nvidia_smi_count(timeout_s: float = 60.0) -> Optional[int]:
  """How many GPUs nvidia-smi lists (in this container), or None without a working nvidia-smi."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=timeout_s, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return len([line for line in out.stdout.splitlines() if line.strip()])


def _has_nvidia_driver() -> bool:
  """Whether an NVIDIA driver is present at all (a cheap gate before probing)."""
  return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def visible_gpus(environ: Optional[dict] = None, probe=None, smi_count=None,
                 has_driver=None) -> tuple[str, ...]:
  """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set (up to a first negative entry,
  which hides the rest from CUDA), else CUDA's ordinals 0..n-1 of the devices the driver
  enumerates (`cuda_probe`, else `nvidia_smi_count`); () without an NVIDIA driver.
  `probe`, `smi_count` and `has_driver` replace those functions (tests)."""
  env = os.environ if environ is None else environ
  if "CUDA_VISIBLE_DEVICES" in env:
    entries = [s.strip() for s in env["CUDA_VISIBLE_DEVICES"].split(",") if s.strip()]
    cut = next((i for i, e in enumerate(entries) if re.fullmatch(r"-\d+", e)), len(entries))
    return parse_ids(",".join(entries[:cut]), "CUDA_VISIBLE_DEVICES")
  if not (has_driver or _has_nvidia_driver)():
    return ()
  probe_env = dict(env)
  probe_env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
  found = (probe or cuda_probe)(probe_env)
  if found is not None:
    return tuple(str(d["ordinal"]) for d in found)
  count = (smi_count or nvidia_smi_count)()
  return tuple(str(i) for i in range(count or 0))


# The NVIDIA pip packages whose shared libraries collide when two CUDA majors are installed, one
# row per library family: (family, distribution-name pattern, where the major comes from).
# "suffix": the -cuNN suffix (CUDA 12 and 13 wheels of cuDNN, NCCL, NVSHMEM, cuSPARSELt install
# the same files, e.g. nvidia/cudnn/lib/libcudnn.so.9); "suffix or version": CUDA 12's -cu12
# wheels, or CUDA 13's unsuffixed ones whose version starts with the major (nvidia-cublas 13.x,
# nvidia-cuda-runtime 13.x, ...; JAX's plugin loads both majors' copies when both are present).
# JAX's CUDA plugin decides which major JAX loads. Packages of other families (e.g.
# nvidia-cutlass-dsl-libs-cu12, vLLM's kernel DSL: its own libraries, none of these) never count.
LIBRARY_PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("cuDNN", r"nvidia-cudnn-cu(\d+)", "suffix"),
    ("NCCL", r"nvidia-nccl-cu(\d+)", "suffix"),
    ("NVSHMEM", r"nvidia-nvshmem-cu(\d+)", "suffix"),
    ("cuSPARSELt", r"nvidia-cusparselt-cu(\d+)", "suffix"),
    ("cuBLAS", r"nvidia-cublas(?:-cu(\d+))?", "suffix or version"),
    ("CUDA runtime", r"nvidia-cuda-runtime(?:-cu(\d+))?", "suffix or version"),
    ("NVRTC", r"nvidia-cuda-nvrtc(?:-cu(\d+))?", "suffix or version"),
    ("CUPTI", r"nvidia-cuda-cupti(?:-cu(\d+))?", "suffix or version"),
    ("JAX CUDA plugin", r"jax-cuda(\d+)-(?:plugin|pjrt)", "suffix"),
)


def library_major(name: str, version: str) -> Optional[tuple[str, int]]:
  """(library family, CUDA major) of a distribution of `LIBRARY_PACKAGES`, else None."""
  norm = re.sub(r"[-_.]+", "-", str(name)).lower()
  for family, pattern, source in LIBRARY_PACKAGES:
    m = re.fullmatch(pattern, norm)
    if m is None:
      continue
    if m.group(1):
      return family, int(m.group(1))
    first = str(version).split(".")[0]
    if source == "suffix or version" and first.isdigit():
      return family, int(first)
  return None


def cuda_majors(distributions: Optional[Sequence[tuple[str, str]]] = None) -> dict[int, list[str]]:
  """{CUDA major: ["name==version", ...]} of the installed packages of `LIBRARY_PACKAGES` (the
  libraries that collide). `distributions` ((name, version) pairs) replaces the installed list
  (tests, a resolved install)."""
  if distributions is None:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    distributions = [(d.metadata["Name"] or "", d.version) for d in metadata.distributions()]
  majors: dict[int, list[str]] = {}
  for name, version in distributions:
    found = library_major(name, version)
    if found is not None:
      majors.setdefault(found[1], []).append(f"{name}=={version}")
  return majors


def check_one_cuda_major(distributions: Optional[Sequence[tuple[str, str]]] = None,
                         environ: Optional[dict] = None) -> None:
  """Raises RuntimeError when the packages of colliding NVIDIA libraries (`LIBRARY_PACKAGES`)
  come in two CUDA majors (JAXREPLAY_ALLOW_MIXED_CUDA=1 skips the check). `distributions`:
  (name, version) pairs instead of the installed ones."""
  env = os.environ if environ is None else environ
  if env.get("JAXREPLAY_ALLOW_MIXED_CUDA", "") == "1":
    return
  majors = cuda_majors(distributions)
  if len(majors) < 2:
    return
  listing = "; ".join(f"CUDA {m}: {', '.join(sorted(p)[:6])}{' ...' if len(p) > 6 else ''}"
                      for m, p in sorted(majors.items()))
  raise RuntimeError(
      f"this environment holds NVIDIA packages of CUDA majors {sorted(majors)} ({listing}). Their "
      "cuDNN, NCCL and NVSHMEM wheels install the same files (nvidia/cudnn/lib/libcudnn.so.9, ...), "
      "so JAX or torch/vLLM would load a build for the other CUDA. vLLM 0.32's torch 2.13 is "
      "CUDA 13: install into a fresh environment with `pip install -e '.[gpu]'` (jax[cuda13]), or "
      "`pip uninstall` the CUDA-12 packages listed; set JAXREPLAY_ALLOW_MIXED_CUDA=1 to go on anyway")


def split_gpus(config, gpus: Sequence[str]) -> GpuSplit:
  """The trainer / worker split of `gpus` chosen by `config.devices` (see the module docstring).

  Raises ValueError naming the keys to change when the split does not match trainer.num_devices
  (T), rollout.num_workers (W) and the engines' tensor-parallel size, or names an absent GPU.
  """
  c = config
  gpus = tuple(str(g) for g in gpus)
  t = int(c.trainer.num_devices)
  backend = backend_table.record(backend_table.resolve(c.rollout.backend))
  per_worker = int(backend.gpus_per_worker(c.rollout))  # 0: the workers take no GPU of their own
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
  if per_worker:
    need = int(c.rollout.num_workers) * per_worker
    if len(workers) < need:
      raise ValueError(
          f"rollout.num_workers={c.rollout.num_workers} {backend.title} workers x {per_worker} GPUs "
          f"need {need} worker GPUs but {len(workers)} are left ({','.join(workers) or 'none'}) "
          f"after the trainer's {','.join(trainer)}; lower rollout.num_workers to "
          f"{len(workers) // per_worker} or trainer.num_devices")
    workers = workers[:need]
  return GpuSplit(trainer=trainer, workers=workers, per_worker=max(per_worker, 1))


def apply_to_environment(config, environ: Optional[dict] = None,
                         visible: Optional[Sequence[str]] = None,
                         distributions: Optional[Sequence[tuple[str, str]]] = None
                         ) -> Optional[GpuSplit]:
  """On a GPU machine: restricts this process (the trainer) to its GPUs and hands the workers
  theirs, through the environment (CUDA_DEVICE_ORDER=PCI_BUS_ID unless set, so that every process
  numbers the GPUs alike); refuses an environment with two CUDA majors (`check_one_cuda_major`);
  must run before JAX is imported. None on machines without GPUs (nothing is changed).
  `visible` / `distributions` replace the probed GPUs / installed packages (tests)."""
  env = os.environ if environ is None else environ
  gpus = tuple(visible) if visible is not None else visible_gpus(env)
  if not gpus:
    return None
  check_one_cuda_major(distributions, env)
  split = split_gpus(config, gpus)
  env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
  env["CUDA_VISIBLE_DEVICES"] = ",".join(split.trainer)
  env["JAXREPLAY_WORKER_GPUS"] = ",".join(split.workers)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(config.devices.memory_fraction))
  return split
