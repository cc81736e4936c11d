"""The run's rollout backend: which workers generate, and how the trainer's weights reach them.

`RolloutBackend.publish(params, version) -> Weights` turns the trainer's parameters into the opaque
handle the workers load with `load_weights`:
  - jax:  `JaxSampler`s in this process get device arrays: a copy of the params (the train step
          donates its own buffers), no host round trip.
  - vllm: `VllmWorkerProcess`es (one engine process per worker), in the engines' dtype
          (rollout.vllm_dtype), by rollout.weight_transport:
          "shm": a shared-memory segment of HF tensors (`ShmPublisher`; engines start from its
                 config-only `model_dir`). GPU engines: the trainer only copies the params to
                 host, the HF-layout segment is written in the background and loaded through
                 vLLM's weight-transfer API. CPU engines: kernels stay in the trainer's layout,
                 the trainer copies them straight into the segment and each engine re-packs its
                 linear layers from it (`rollout.vllm.direct_load`);
          "file": an HF directory written per refresh by `FilePublisher` (to /dev/shm).
          Each engine loads a refresh in one RPC.
LoRA (model.lora_rank > 0, `lora=` the trainer's `learner.adapters.FrozenBase`): the published
params are the adapters and only they travel, under the transport "lora" of the tables
(`rollout.weights.adapter_publisher`): JAX samplers get the frozen base with a device copy of the
adapters attached; vLLM engines start from the base's HF directory with LoRA enabled and register
each version's adapter directory (PEFT's format) as a new vLLM adapter (rollout.weight_transport is
not used).
With several trainer processes every process gathers full host copies first (a collective).
`make_worker(index, weights)` builds worker `index` holding `weights`; the schedules
(`jaxreplay.run.schedules`) decide how many workers run and when they load newer weights.

Where the workers run (rollout.placement):
  - "local" (default): in this process (JAX samplers) or in child processes of this machine (vLLM).
  - "ray": as Ray actors with declared resources (`rollout.ray.group`: one placement group, a
    bundle per worker; Ray restarts a dead actor and the pool re-attaches to it). Weights go
    through Ray's object store (`ObjectStorePublisher`: JAX samplers get the numpy parameter
    pytree, vLLM engines the HF state dict in rollout.vllm_dtype); rollout.weight_transport is not
    used. The async schedule gets one actor per worker (W), the simulated and sync schedules the
    one actor their local worker uses.

Which workers and publishers exist, and every fact other layers need about a backend, is one
record per backend in `rollout.backend_table.BACKENDS`; this module holds the factories its
records name and `RolloutBackend`, which reads the record (no test of a backend's name here).
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Sequence

from absl import logging
import jax

from jaxreplay.infra import sharding
from jaxreplay.rollout import backend_table
from jaxreplay.rollout.base import RolloutWorker, Weights
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.rollout.base import StaleWeights

EVAL_KEEP = 2  # versions the evaluation publisher keeps (shm, object store; 1 for HF dirs)


# ---- publisher factories (named by the records' `publishers`): f(backend, keep) -> Publisher -------

def device_copies(backend: "RolloutBackend", keep: int):
  """JAX samplers in this process: device copies of the params (no host round trip)."""
  from jaxreplay.rollout.weights.publisher import DeviceCopyPublisher  # pylint: disable=g-import-not-at-top
  del keep
  return DeviceCopyPublisher(backend.model_cfg, copy=jax.process_count() == 1)


def shm_segments(backend: "RolloutBackend", keep: int):
  """vLLM engines of this machine, transport "shm". CPU engines re-pack every kernel from the
  trainer's [in, out] layout (`vllm.direct_load`): no transposes, written on the trainer's thread.

  /dev/shm must hold every slot of both publishers (a write past it is a SIGBUS): the rollout one
  checks room for its own slots and the evaluation one's (when evaluation runs on the engines); the
  evaluation one, made later, for its own and what the rollout one has still to allocate."""
  from jaxreplay.rollout.weights.shm_publisher import ShmPublisher  # pylint: disable=g-import-not-at-top
  kernel_layout = "jax" if backend.engines_on_cpu else "hf"
  if backend.publisher is None:
    reserve = (ShmPublisher.bytes_needed(backend.model_cfg, backend.dtype, EVAL_KEEP, kernel_layout)
               if backend.evaluates_on_engines else 0)
  else:
    reserve = backend.publisher.pending_bytes()
  return ShmPublisher(backend.model_cfg, backend.dtype, keep=max(keep, 2),
                      kernel_layout=kernel_layout, reserve_bytes=reserve)


def hf_dirs(backend: "RolloutBackend", keep: int):
  """vLLM engines of this machine, transport "file": an HF directory per version."""
  from jaxreplay.rollout.weights.file_publisher import FilePublisher  # pylint: disable=g-import-not-at-top
  return FilePublisher(backend.model_cfg, backend.dtype, keep=keep)


def object_store_params(backend: "RolloutBackend", keep: int):
  """Ray actors of JAX samplers: the numpy params in their own dtype (as in-process ones get)."""
  from jaxreplay.rollout.ray import publisher as ray_publisher  # pylint: disable=g-import-not-at-top
  return ray_publisher.ObjectStorePublisher(backend.model_cfg, "params", None, keep=keep)


def object_store_hf(backend: "RolloutBackend", keep: int):
  """Ray actors of engines: the HF state dict in the engines' dtype."""
  from jaxreplay.rollout.ray import publisher as ray_publisher  # pylint: disable=g-import-not-at-top
  return ray_publisher.ObjectStorePublisher(backend.model_cfg, "hf", backend.dtype, keep=keep)


def adapter_device_copies(backend: "RolloutBackend", keep: int):
  """LoRA, JAX samplers in this process: the base with a device copy of the adapters attached."""
  from jaxreplay.rollout.weights.adapter_publisher import AdapterDeviceCopyPublisher  # pylint: disable=g-import-not-at-top
  del keep
  return AdapterDeviceCopyPublisher(backend.model_cfg, backend.lora)


def adapter_dirs(backend: "RolloutBackend", keep: int):
  """LoRA, vLLM engines of this machine: one PEFT adapter directory per version in /dev/shm, in
  the engines' dtype. The first call also writes the base's HF directory the engines start from
  (`backend.lora_model_dir`)."""
  from jaxreplay.rollout.weights.adapter_publisher import AdapterDirPublisher, BaseModelDir  # pylint: disable=g-import-not-at-top
  if backend.lora_model_dir is None:
    backend.lora_model_dir = BaseModelDir(backend.model_cfg, backend.lora.params, backend.lora.path,
                                          backend.dtype)
  return AdapterDirPublisher(backend.model_cfg, backend.lora.spec, backend.dtype,
                             keep=max(keep, 2), base_model_name_or_path=backend.lora.path)


# ---- worker factories (named by the records' `workers`): f(backend, index, weights) -> worker ------

def jax_sampler(backend: "RolloutBackend", index: int, weights: Weights) -> RolloutWorker:
  c = backend.config
  return JaxSampler(backend.model_cfg, weights.params, c.model.max_len,
                    batch_size=c.rollout.sampler_batch_size, eos_token_ids=backend.stop_ids,
                    seed=backend.worker_seed(index), policy_version=weights.version)


def vllm_process(backend: "RolloutBackend", index: int, weights: Weights) -> RolloutWorker:
  """A vLLM engine in its own process on this machine's worker GPUs (or CPU)."""
  from jaxreplay.rollout.vllm.engine import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
  settings = dict(backend.settings)
  env = dict(settings.pop("env"))
  seed = backend.worker_seed(index)
  env.update(_worker_gpus_env(backend, index))  # tensor_parallel_size worker GPUs per worker
  if backend.transport == "file":
    return VllmWorkerProcess(weights.hf_dir, policy_version=weights.version, seed=seed, env=env,
                             eos_token_ids=backend.stop_ids,
                             startup_timeout_s=backend.startup_timeout_s, **settings)
  # shm: the engine starts from the config-only dir with random stand-in weights, then loads these.
  worker = VllmWorkerProcess(backend.publisher.model_dir, weights_pending=True, policy_version=-1,
                             seed=seed, env=env, eos_token_ids=backend.stop_ids,
                             startup_timeout_s=backend.startup_timeout_s, **settings)
  return _first_load(worker, index, weights)


def _first_load(worker, index: int, weights: Weights) -> RolloutWorker:
  """`worker` (just started, holding no policy) given `weights`; killed when that fails."""
  try:
    worker.load_weights(weights)
  except StaleWeights:
    # Newer versions replaced these while the engine started (tens of seconds): the worker holds
    # no weights yet (version -1); the pool loads its newest target next.
    logging.info("rollout worker %d started after version %d was superseded; it loads the "
                 "newest next", index, weights.version)
  except BaseException:
    worker.kill()
    raise
  return worker


def vllm_lora_process(backend: "RolloutBackend", index: int, weights: Weights) -> RolloutWorker:
  """LoRA: a vLLM engine in its own process started from the base's HF directory with LoRA on,
  then given the version's adapter."""
  from jaxreplay.models.lora import vllm_max_lora_rank  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm.engine import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
  settings = dict(backend.settings)
  env = dict(settings.pop("env"))
  env.update(_worker_gpus_env(backend, index))
  worker = VllmWorkerProcess(backend.lora_model_dir.path, policy_version=-1,
                             max_lora_rank=vllm_max_lora_rank(backend.lora.spec.rank),
                             seed=backend.worker_seed(index), env=env,
                             eos_token_ids=backend.stop_ids,
                             startup_timeout_s=backend.startup_timeout_s, **settings)
  return _first_load(worker, index, weights)


def _worker_gpus_env(backend: "RolloutBackend", index: int) -> dict[str, str]:
  """CUDA_VISIBLE_DEVICES of vLLM worker `index` (jaxreplay.config.devices, launch), or {}."""
  gpus = [g for g in os.environ.get("JAXREPLAY_WORKER_GPUS", "").split(",") if g]
  if not gpus:
    return {}
  groups = worker_gpu_groups(gpus, backend.config.rollout.vllm_tensor_parallel_size)
  return {"CUDA_VISIBLE_DEVICES": ",".join(groups[index % len(groups)])}


def ray_actor(backend: "RolloutBackend", index: int, weights: Weights) -> RolloutWorker:
  """Actor `index` of the Ray group (made on first use, re-attached after a restart); what runs
  in it is the record's `actor_host`."""
  return backend.ray_group.make_worker(index, weights)


class RolloutBackend:
  """Makes the rollout workers of one run and publishes weights to them, by the factories of its
  record in `backend_table.BACKENDS`.

  Args:
    config: the run config (rollout.backend resolved: a name of `backend_table.BACKENDS`;
      rollout.*, model.max_len).
    model_cfg: the policy's `ModelConfig`.
    stop_ids: token ids that end a completion (the tokenizer's eos ids).
    serves_workers: False on trainer processes other than 0 under the multi-process async
      schedule: process 0 owns the workers, so `publish` here only takes part in the host copy (a
      collective) and returns a version-only handle, and `make_worker` refuses.
    lora: LoRA's `learner.adapters.FrozenBase` (its spec, params, path, model_params): `publish`
      then takes the adapters (transport "lora"); None for full weights.
    num_actors: Ray actors under rollout.placement="ray" (`Schedule.num_actors(config)`: W for the
      async schedule, 1 for the simulated and sync ones, whose one local worker it is).
  """

  def __init__(self, config, model_cfg, stop_ids, serves_workers: bool = True, lora=None,
               num_actors: int = 1):
    self.config, self.model_cfg, self.stop_ids = config, model_cfg, tuple(stop_ids)
    self.serves_workers = bool(serves_workers)
    self.lora = lora
    self.lora_model_dir = None  # LoRA on engines: the base's HF dir they start from (`adapter_dirs`)
    self.num_actors = int(num_actors)
    self.backend = config.rollout.backend
    self.record = rec = backend_table.record(self.backend)
    self.publisher = self._eval_publisher = None
    self.transport = None
    self.placement = config.rollout.get("placement", "local")
    if self.placement not in backend_table.placements():
      raise ValueError(f"rollout.placement={self.placement!r}: expected one of "
                       f"{backend_table.placements()}")
    self.ray_group = None
    on_cpu = jax.default_backend() == "cpu"
    if self.placement == "ray":  # the engines run where their bundles' GPUs (or none) are
      self.ray_gpus = ray_gpus_per_worker(config, on_cpu)
      on_cpu = self.ray_gpus == 0
    self.engines_on_cpu = on_cpu
    self.startup_timeout_s = vllm_startup_timeout(config, on_cpu)
    self.settings = None  # the engines' keyword arguments ("env", "dtype" included), if engines
    if rec.engine_settings is not None:
      self.settings = backend_table.load(rec.engine_settings)(config, on_cpu=on_cpu)
    if rec.weight_transports:
      self.transport = config.rollout.weight_transport
      if self.transport not in rec.weight_transports:
        raise ValueError(f"rollout.weight_transport={self.transport!r}: expected one of "
                         f"{rec.weight_transports}")
    if lora is not None:
      self.transport = "lora"  # only the adapters travel (whatever rollout.weight_transport says)
    # Under Ray the object store carries the weights, whatever the transport.
    self._publisher_key = (self.placement, self.transport if self.placement == "local" else None)
    worker_key = (self.placement,) + (("lora",) if lora is not None else ())
    if worker_key not in rec.workers or self._publisher_key not in rec.publishers:
      raise ValueError(f"rollout.backend={self.backend!r} with rollout.placement="
                       f"{self.placement!r}{' and LoRA' if lora is not None else ''} is not built; "
                       "LoRA adapters reach local workers only (rollout.placement='local')")
    self._make_worker = backend_table.load(rec.workers[worker_key])
    if not self.serves_workers:
      return  # process 0 owns the workers (and Ray): nothing to start here
    try:
      if self.placement == "ray":
        self.ray_group = self._make_ray_group()
      self.publisher = self._make_publisher(keep=int(config.rollout.get("keep_versions", 3)))
    except BaseException:
      self.close()
      raise

  @property
  def evaluates_on_engines(self) -> bool:
    """Whether evaluation runs on these workers (eval.backend "engines", or "auto" with a backend
    whose record evaluates on its engines), so that an evaluation publisher will start beside the
    rollout one."""
    c = self.config
    where = c.eval.get("backend", "auto") if "eval" in c else "trainer"
    return bool(c.eval.num_problems) and backend_table.resolve_eval(where, self.backend) == "engines"

  @property
  def dtype(self) -> str:
    """The engines' dtype, which weights are published in (backends with engine settings)."""
    return self.settings["dtype"]

  def publish(self, params, version: int) -> Weights:
    """The weights handle of `params` at policy `version` (see the module docstring). With the
    shm transport it returns once the params are on host; `Weights.ready` settles when written."""
    return self._publish(self.publisher, params, version)

  def publish_eval(self, params, version: int) -> Weights:
    """As `publish`, for a version the workers only evaluate (a step that was not published): its
    own publisher, so the rollout versions are never pushed out."""
    if self._eval_publisher is None and self.serves_workers:
      self._eval_publisher = self._make_publisher(
          keep=EVAL_KEEP if self.transport == "shm" or self.placement == "ray" else 1)
    return self._publish(self._eval_publisher, params, version)

  def _make_publisher(self, keep: int):
    return backend_table.load(self.record.publishers[self._publisher_key])(self, keep)

  def _make_ray_group(self):
    """The Ray actors' group (`rollout.ray.group.RayRolloutGroup`): connects to / starts Ray."""
    from jaxreplay.rollout.ray import group as ray_group  # pylint: disable=g-import-not-at-top
    c, r = self.config, self.config.rollout
    env, engine_kwargs, config_files, dtype = {}, {}, {}, "float32"
    if self.settings is not None:  # engines: started from a config-only dir written on their node
      engine_kwargs = dict(self.settings)
      env = dict(engine_kwargs.pop("env"))
      dtype = engine_kwargs.pop("dtype")
      config_files = vllm_config_files(self.model_cfg, dtype)
    spec = ray_group.WorkerSpec(
        backend=self.backend, model_cfg=self.model_cfg, max_len=int(c.model.max_len),
        sampler_batch_size=int(r.sampler_batch_size), eos_token_ids=self.stop_ids, seed=int(c.seed),
        dtype=dtype, engine_kwargs=engine_kwargs, env=env, config_files=config_files)
    return ray_group.RayRolloutGroup(
        spec, self.num_actors, address=str(r.ray_address),
        num_cpus_per_worker=float(r.ray_num_cpus_per_worker),
        num_gpus_per_worker=self.ray_gpus,
        strategy=str(r.ray_placement_strategy), max_restarts=int(r.ray_max_restarts),
        startup_timeout_s=self.startup_timeout_s)

  def _publish(self, publisher, params, version: int) -> Weights:
    if jax.process_count() > 1:  # a collective: every trainer process publishes at the same step
      params = sharding.host_local(params)
    if not self.serves_workers:  # process 0 hands its copy to the workers
      return Weights(version=int(version), cfg=self.model_cfg)
    return publisher.publish(params, version)

  @property
  def requests_per_call(self) -> int:
    """Whole requests a pool worker takes into one `generate` call (see `requests_per_call`)."""
    return requests_per_call(self.config)

  def worker_seed(self, index: int) -> int:
    """Worker `index`'s sampling seed (from config.seed)."""
    return self.config.seed + 1000 * (index + 1)

  def make_worker(self, index: int, weights: Weights) -> RolloutWorker:
    """A new worker `index` holding `weights` (the record's worker factory of this placement)."""
    if not self.serves_workers:
      raise RuntimeError("rollout workers run on trainer process 0 only (multi-process async "
                         "schedule); this process has none")
    return self._make_worker(self, index, weights)

  def close(self) -> None:
    for name in ("publisher", "_eval_publisher"):
      publisher = getattr(self, name)
      if publisher is not None:
        publisher.close()
        setattr(self, name, None)
    if self.ray_group is not None:  # the actors, the placement group (and Ray, if started here)
      self.ray_group.close()
      self.ray_group = None
    if self.lora_model_dir is not None:
      self.lora_model_dir.close()
      self.lora_model_dir = None


def ray_gpus_per_worker(config, on_cpu: bool) -> float:
  """rollout.ray_num_gpus_per_worker with -1 (auto) resolved: the backend's `gpus_per_worker` on a
  GPU machine (this process's JAX backend: `on_cpu` False; vllm_tensor_parallel_size for vLLM, 0
  for JAX samplers), else 0. The vLLM engine settings of Ray actors follow it (GPU settings when
  the actors get GPUs)."""
  r = config.rollout
  gpus = float(r.ray_num_gpus_per_worker)
  if gpus >= 0:
    return gpus
  if gpus != -1:
    raise ValueError(f"rollout.ray_num_gpus_per_worker={r.ray_num_gpus_per_worker}: expected -1 "
                     "(auto) or a count >= 0")
  return 0.0 if on_cpu else float(backend_table.record(r.backend).gpus_per_worker(r))


def vllm_config_files(model_cfg, dtype: str) -> dict[str, bytes]:
  """{name: bytes} of a config-only model dir (config.json, generation_config.json, written by
  `hf_io.write_config_files` as `ShmPublisher.model_dir` is), for engines on other nodes."""
  from jaxreplay.models import hf_io  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="jaxreplay-config-") as d:
    hf_io.write_config_files(model_cfg, d, dtype)
    out = {}
    for name in sorted(os.listdir(d)):
      with open(os.path.join(d, name), "rb") as f:
        out[name] = f.read()
  return out


TRI_STATE = ("auto", "true", "false")


def _tri_state(value, name: str, auto: bool) -> bool:
  """"auto" -> `auto`, "true"/"false" (any case, or a bool) -> that value."""
  if isinstance(value, bool):
    return value
  v = str(value).lower()
  if v not in TRI_STATE:
    raise ValueError(f"rollout.{name}={value!r}: expected one of {TRI_STATE}")
  return auto if v == "auto" else v == "true"


def vllm_engine_settings(config, on_cpu: bool) -> dict:
  """The `VllmEngine` keyword arguments of the config's rollout.vllm_* keys, "auto" resolved.

  On CPU (the test backend): float32, eager, no torch.compile, the engine core in the worker's
  process (start-up in seconds), a KV cache of rollout.vllm_kv_cache_gib GiB. On GPU, as vLLM is
  meant to run: bfloat16, torch.compile + CUDA graphs, the engine core in vLLM's own process (its
  scheduling overlaps the GPU's work), gpu_memory_utilization of the worker's GPU(s) and
  tensor_parallel_size GPUs per engine. Returns a dict with an "env" entry (the worker process's
  environment) and the engine's keyword arguments.
  """
  r = config.rollout
  eager = _tri_state(r.vllm_enforce_eager, "vllm_enforce_eager", auto=on_cpu)
  own_process = _tri_state(r.vllm_engine_process, "vllm_engine_process", auto=not on_cpu)
  settings = dict(
      max_model_len=int(r.vllm_max_model_len or config.model.max_len),
      max_num_seqs=int(r.vllm_max_num_seqs),
      dtype=_engine_dtype(r.get("vllm_dtype", "auto"), on_cpu),
      enforce_eager=eager,
      disable_torch_compile=eager,  # eager: nothing to compile (vLLM's sampler helpers included)
      env={"VLLM_CPU_KVCACHE_SPACE": str(r.vllm_kv_cache_gib),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if own_process else "0",
           # vLLM's own wait for its engine-core process (600 s by default) gets the same budget.
           "VLLM_ENGINE_READY_TIMEOUT_S": str(int(math.ceil(vllm_startup_timeout(config, on_cpu))))})
  if not on_cpu:
    settings["engine_kwargs"] = dict(gpu_memory_utilization=float(r.vllm_gpu_memory_utilization),
                                     tensor_parallel_size=int(r.vllm_tensor_parallel_size))
  return settings


CPU_STARTUP_TIMEOUT_S = 300.0  # an eager CPU engine starts in seconds; a loaded machine: minutes
GPU_STARTUP_BASE_S = 600.0     # one GPU engine: cold torch.compile + CUDA-graph capture
GPU_STARTUP_PER_ENGINE_S = 300.0  # each engine starting at once: their compiles share the CPUs


def vllm_startup_timeout(config, on_cpu: bool) -> float:
  """rollout.vllm_startup_timeout_s with 0 (auto) resolved [s]: CPU_STARTUP_TIMEOUT_S on CPU;
  on GPU GPU_STARTUP_BASE_S + GPU_STARTUP_PER_ENGINE_S per engine that starts at once
  (rollout.num_workers: the async pool starts them together, each compiling cold)."""
  r = config.rollout
  value = float(r.get("vllm_startup_timeout_s", 0.0))
  if value < 0:
    raise ValueError(f"rollout.vllm_startup_timeout_s={value} must be >= 0 [s] (0 = auto)")
  if value > 0:
    return value
  if on_cpu:
    return CPU_STARTUP_TIMEOUT_S
  return GPU_STARTUP_BASE_S + GPU_STARTUP_PER_ENGINE_S * max(int(r.num_workers), 1)


def _engine_dtype(value: str, on_cpu: bool) -> str:
  """rollout.vllm_dtype with "auto" resolved: float32 on CPU (the test backend), else bfloat16."""
  if value not in backend_table.VLLM_DTYPES:
    raise ValueError(f"rollout.vllm_dtype={value!r}: expected one of {backend_table.VLLM_DTYPES}")
  if value == "auto":
    return "float32" if on_cpu else "bfloat16"
  return value


def requests_per_call(config) -> int:
  """Whole requests (rollout.prompts_per_request prompts x group_size) one worker takes into one
  `generate` call, so that an engine runs full: rollout.prompts_in_flight // prompts_per_request,
  or when 0 (auto) as many as fill rollout.vllm_max_num_seqs sequences (a backend whose record
  `fills_engine`: vLLM) or one (the JAX sampler).

  Auto never takes more rollouts per call than the buffer holds (buffer.size, N): a call's requests
  land together, and rollouts beyond N would push each other out of the FIFO before any is used.
  The paper's N=84 with requests of 4 x 16 therefore keeps one request per call."""
  r = config.rollout
  if r.prompts_in_flight:
    return max(1, r.prompts_in_flight // r.prompts_per_request)
  if not backend_table.record(r.backend).fills_engine:
    return 1
  request = r.prompts_per_request * r.group_size
  return max(1, min(r.vllm_max_num_seqs, config.buffer.size) // request)


def worker_gpu_groups(gpu_ids: Sequence, tensor_parallel_size: int) -> list[tuple[str, ...]]:
  """Splits the worker GPUs into one group of `tensor_parallel_size` per vLLM worker.

  Args:
    gpu_ids: the GPU ids the rollout workers may use (ints or strings, CUDA_VISIBLE_DEVICES order).
    tensor_parallel_size: GPUs per engine (rollout.vllm_tensor_parallel_size).
  Returns:
    len(gpu_ids) // tensor_parallel_size tuples of id strings; worker i takes group i (its
    CUDA_VISIBLE_DEVICES).
  Raises:
    ValueError when the ids are empty or repeated, or do not divide into groups of that size.
  """
  ids = [str(g).strip() for g in gpu_ids]
  tp = int(tensor_parallel_size)
  if tp < 1:
    raise ValueError(f"rollout.vllm_tensor_parallel_size={tp} must be >= 1")
  if not ids:
    raise ValueError("no worker GPUs given; list them (e.g. JAXREPLAY_WORKER_GPUS=4,5,6,7)")
  if len(set(ids)) != len(ids):
    raise ValueError(f"worker GPUs {ids} name a GPU twice; list each GPU once")
  if len(ids) % tp:
    raise ValueError(f"{len(ids)} worker GPUs {ids} do not split into engines of "
                     f"rollout.vllm_tensor_parallel_size={tp} GPUs; give a multiple of {tp} worker "
                     f"GPUs (e.g. {len(ids) - len(ids) % tp or tp}) or a tensor_parallel_size that "
                     f"divides {len(ids)}")
  return [tuple(ids[i:i + tp]) for i in range(0, len(ids), tp)]
