"""Rollout workers as Ray actors (rollout.placement="ray"): declared resources, started and restarted
by Ray, weights through Ray's object store.

Only `workers.RolloutBackend` imports this module, and only when rollout.placement is "ray"; the
no-Ray default stays `WorkerPool` over in-process `JaxSampler`s or `VllmWorkerProcess`es.

  - `RolloutActor`: one worker inside a Ray actor process: a `JaxSampler` (JAX_PLATFORMS=cpu in the
    actor's runtime env when it has no GPU) or an in-process `VllmEngine`, started with
    `weights_pending=True` from a config-only model dir that the actor writes from config-file
    bytes shipped by the driver (another node cannot read the driver's /dev/shm). Actors start
    without weights (version -1): the driver loads them (`make_worker`), also after a restart.
  - `RayWorker`: the driver's proxy of an actor, a `RolloutWorker`; Ray's actor errors
    (`RayActorError`: died, unavailable, ...) become `WorkerDied`, so a `WorkerPool` drops the
    in-flight request and calls `make_worker(i)` again.
  - `RayRolloutGroup`: connects to Ray (or starts a local instance), reserves ONE placement group
    of W bundles {"CPU": c, "GPU": g} with the configured strategy, and creates actor i in bundle i
    (`max_restarts`, `max_task_retries=0`: a request in flight when its actor dies fails, it is
    never re-run behind the pool's back). `make_worker(i, weights)` makes actor i on first use;
    later calls (the pool replacing a dead worker) attach a new proxy to the SAME actor once Ray
    has restarted it and bring it to `weights`: Ray's restart is the respawn. An actor dead for
    good (restarts exhausted, or its constructor failed) raises `WorkerDied`.
  - `ObjectStorePublisher`: one object per version in Ray's object store, `ray.put` on a background
    thread (the trainer's stall is the device -> host copy, as with `ShmPublisher`): JAX actors get
    the numpy parameter pytree, vLLM actors the HF-named, HF-layout state dict in the engines'
    dtype (bf16 through ml_dtypes). Only the newest `keep` versions stay referenced; loading an
    older one raises `StaleWeights` (the pool then loads its newest target).

A vLLM actor copies the received tensors into a node-local shared-memory segment
(`shm_weights.SlotRing`) and loads it through the engine's tested path (`VllmEngine.load_weights`
with `shm_path`: vLLM's weight-transfer session); a JAX actor `device_put`s the pytree.
Not built: GPU NCCL broadcast from the trainer to the engines (no GPU to test it here); GPU engines
get the object-store copy (a host round trip). vLLM tensor parallelism inside one actor (bundles of
tp GPUs) is untested.

Every node must import jaxreplay (installed there, or a shared checkout: the actors' PYTHONPATH
starts with the driver's jaxreplay checkout). The module imports no JAX at module level: a vLLM
actor never imports JAX.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import signal
import socket
import threading
import time
from typing import Any, Optional, Sequence

from absl import logging
import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxreplay.rollout import shm_weights
from jaxreplay.rollout.base import Group, SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.shm_weights import StaleWeights

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray errors that mean "this worker's process (or node) is gone", not a bug in the request.
_DEATH_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- what an actor runs -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  """What every actor of a group builds (picklable; shipped to the actors).

  backend: "jax" (a `JaxSampler`) or "vllm" (an in-process `VllmEngine`).
  model_cfg: the policy's `ModelConfig`. max_len: prompt + completion tokens of the JAX sampler.
  sampler_batch_size: rows per jitted batch (jax). eos_token_ids: ids that end a completion.
  seed: the run's seed; actor i's sampler seed is seed + 1000 * (i + 1) (`seed_of`), as for
    local workers. dtype: the engines' dtype ("float32" | "bfloat16" | "float16"; vllm).
  engine_kwargs: `VllmEngine` keyword arguments (`workers.vllm_engine_settings` without "env").
  env: environment variables of the actor process (its runtime env; vLLM reads them at import).
  config_files: {file name: bytes} of the config-only model dir (config.json,
    generation_config.json) that a vLLM actor writes on its own node.
  """
  backend: str
  model_cfg: Any
  max_len: int
  sampler_batch_size: int = 64
  eos_token_ids: tuple[int, ...] = ()
  seed: int = 0
  dtype: str = "float32"
  engine_kwargs: dict = dataclasses.field(default_factory=dict)
  env: dict = dataclasses.field(default_factory=dict)
  config_files: dict = dataclasses.field(default_factory=dict)

  def seed_of(self, index: int) -> int:
    """Worker `index`'s sampler seed (`RolloutBackend.make_worker`'s rule)."""
    return int(self.seed) + 1000 * (int(index) + 1)


class RolloutActor:
  """One rollout worker inside a Ray actor process (wrapped with `ray.remote` by the group).

  Args:
    spec: the `WorkerSpec`. index: the worker's slot (its seed derives from it).
  Starts without weights (policy_version -1): `load_weights` must come before `generate`.
  """

  def __init__(self, spec: WorkerSpec, index: int):
    start = time.perf_counter()
    self.spec, self.index = spec, int(index)
    self._root = self._owner_fd = self._ring = None
    if spec.backend == "jax":
      from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
      self.worker = JaxSampler(spec.model_cfg, None, spec.max_len,
                               batch_size=spec.sampler_batch_size,
                               eos_token_ids=spec.eos_token_ids, seed=spec.seed_of(index),
                               policy_version=-1)
    elif spec.backend == "vllm":
      from jaxreplay.rollout.vllm_worker import VllmEngine  # pylint: disable=g-import-not-at-top
      from jaxreplay.rollout.weight_sync import claim_root  # pylint: disable=g-import-not-at-top
      # This node's /dev/shm: the config-only model dir and the segment the engine loads from.
      self._root, _, self._owner_fd = claim_root(None)
      model_dir = os.path.join(self._root, "model")
      os.makedirs(model_dir, exist_ok=True)
      for name, data in spec.config_files.items():
        with open(os.path.join(model_dir, name), "wb") as f:
          f.write(data)
      self._ring = shm_weights.SlotRing(self._root)
      self.worker = VllmEngine(model_dir, weights_pending=True, policy_version=-1,
                               seed=spec.seed_of(index), eos_token_ids=spec.eos_token_ids,
                               dtype=spec.dtype, env=dict(spec.env), **spec.engine_kwargs)
    else:
      raise ValueError(f"WorkerSpec.backend={spec.backend!r}: expected 'jax' or 'vllm'")
    self.startup_seconds = time.perf_counter() - start

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """The worker's `generate` (groups tagged with the version it holds)."""
    if self.worker.policy_version < 0:
      raise RuntimeError(f"rollout actor {self.index} holds no weights yet; call load_weights "
                         "first (RayRolloutGroup.make_worker does)")
    return self.worker.generate(prompts, n, sampling)

  def load_weights(self, version: int, payload: Any) -> dict[str, float]:
    """Loads `payload` (the object-store value: Ray resolves the driver's ref to it before this
    runs) as `version`. Returns the phases [s]: jax device_put_s; vllm segment_write_s and the
    engine's (load_s, repack_s, ...); both actor_s."""
    start = time.perf_counter()
    if self.spec.backend == "jax":
      import jax  # pylint: disable=g-import-not-at-top
      params = jax.block_until_ready(jax.device_put(payload))
      phases = {"device_put_s": time.perf_counter() - start}
      self.worker.load_weights(Weights(int(version), params=params, cfg=self.spec.model_cfg))
    else:
      sources = [(name, tuple(x.shape), False, (lambda x=x: x)) for name, x in payload.items()]
      path, nbytes = self._ring.write(sources, self.spec.dtype, int(version), protect=set())
      written = time.perf_counter() - start
      phases = dict(self.worker.load_weights(Weights(int(version), shm_path=path)))
      phases.update(segment_write_s=written, bytes=float(nbytes))
    phases["actor_s"] = time.perf_counter() - start
    return phases

  def stats(self) -> dict[str, Any]:
    """Where and what this actor is: index, pid, node id, hostname, node IP, GPU ids,
    policy_version, start-up seconds."""
    ctx = ray.get_runtime_context()
    return {"index": self.index, "pid": os.getpid(), "node_id": ctx.get_node_id(),
            "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "backend": self.spec.backend,
            "policy_version": int(self.worker.policy_version),
            "startup_seconds": self.startup_seconds}

  def ping(self) -> int:
    """This actor's pid (it answers: it is alive and not busy)."""
    return os.getpid()

  def get_call_count(self) -> int:
    return self._sampler().call_count

  def set_call_count(self, value: int) -> None:
    self._sampler().call_count = int(value)

  def close(self) -> None:
    """Releases the engine and this node's segment files (the group then kills the process)."""
    self.worker.close()
    if self._ring is not None:
      self._ring.remove()
    if self._root is not None:
      from jaxreplay.rollout.weight_sync import release_root  # pylint: disable=g-import-not-at-top
      release_root(self._root, True, self._owner_fd)
      self._root = self._owner_fd = None

  def _sampler(self):
    if self.spec.backend != "jax":
      raise AttributeError("call_count: only JAX-sampler actors count their calls")
    return self.worker


# ---- the driver's proxy -------------------------------------------------------------------------


def stored_weights(weights: Weights) -> "StoredWeights":
  """The `StoredWeights` of an object-store handle (waits for its background put); ValueError for
  a handle without one."""
  if not isinstance(weights, Weights):
    raise TypeError(f"load_weights takes a jaxreplay.rollout.base.Weights, got {type(weights)}")
  ref = weights.object_ref
  if ref is None:
    raise ValueError(f"Weights of version {weights.version} carry no object-store copy, which Ray "
                     "actors load (rollout.placement='ray'); publish them with "
                     "RolloutBackend.publish under placement 'ray' (or ObjectStorePublisher)")
  weights.wait()
  if isinstance(ref, concurrent.futures.Future):
    ref = ref.result()
  return ref


class RayWorker:
  """The driver's `RolloutWorker` proxy of one `RolloutActor` (made by `RayRolloutGroup`).

  The actor belongs to the group: `close()` only detaches this proxy (the next proxy of the slot
  attaches to the same actor), `RayRolloutGroup.close` ends the actors. Any Ray actor error
  (killed, crashed, node lost, restarting) raises `WorkerDied`.

  Attributes: index, pid, node_id, hostname, policy_version (the version of the weights held),
  info (the actor's `stats()` when attached).
  """

  def __init__(self, actor, index: int, info: dict[str, Any],
               request_timeout_s: Optional[float] = None):
    self._actor = actor
    self.index = int(index)
    self.info = dict(info)
    self.pid, self.node_id, self.hostname = info["pid"], info["node_id"], info["hostname"]
    self.policy_version = int(info["policy_version"])
    self.request_timeout_s = request_timeout_s
    self.last_load_phases: dict[str, float] = {}

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """The actor's `generate` (one Group per prompt, tagged with the version it held)."""
    prompts = [np.asarray(p) for p in prompts]
    return self._call("generate", (prompts, int(n), sampling), self.request_timeout_s)

  def load_weights(self, weights: Weights) -> dict[str, float]:
    """Loads the object-store copy of `weights` (waits for its put). Raises `StaleWeights` when its
    publisher has dropped that version (newer ones replaced it). Returns the phases [s]: the actor's
    (`RolloutActor.load_weights`) and total_s, measured here (incl. the object's transfer)."""
    stored = stored_weights(weights)
    ref = stored.ref  # a local reference: the object lives while this call uses it
    if ref is None:
      raise StaleWeights(f"the object-store copy of version {weights.version} was dropped (its "
                         "publisher keeps only the newest versions); load a newer one")
    start = time.perf_counter()
    phases = dict(self._call("load_weights", (int(weights.version), ref), self.request_timeout_s))
    phases["total_s"] = time.perf_counter() - start
    self.policy_version = int(weights.version)
    self.last_load_phases = phases
    return phases

  def stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
    """The actor's `stats()` (pid, node id, hostname, policy_version, ...)."""
    return self._call("stats", (), timeout_s)

  def ping(self, timeout_s: float = 30.0) -> int:
    """The actor's pid; WorkerDied when it does not answer within `timeout_s`."""
    return self._call("ping", (), timeout_s)

  @property
  def call_count(self) -> int:
    """JAX-sampler actors: generate calls so far (the noise stream; `JaxSampler.call_count`).
    Other actors have no such attribute (`hasattr` is False)."""
    self._require_jax()
    return self._call("get_call_count", (), 60.0)

  @call_count.setter
  def call_count(self, value: int) -> None:
    self._require_jax()
    self._call("set_call_count", (int(value),), 60.0)

  def close(self) -> None:
    """Detaches this proxy; the actor lives on in its group."""
    self._actor = None

  def kill(self) -> None:
    """Kills the actor's process now (Ray restarts it while restarts are left)."""
    actor = self._actor
    if actor is not None:
      ray.kill(actor, no_restart=False)

  def _require_jax(self) -> None:
    if self.info.get("backend") != "jax":
      raise AttributeError("call_count: only JAX-sampler actors count their calls")

  def _call(self, method: str, args: tuple, timeout_s: Optional[float]):
    actor = self._actor
    if actor is None:
      raise RuntimeError(f"this proxy of rollout actor {self.index} was closed; ask the group for "
                         "a new one (make_worker)")
    try:
      return ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
    except _DEATH_ERRORS as e:
      raise WorkerDied(f"rollout actor {self.index} (pid {self.pid} on {self.hostname}) died "
                       f"during {method}: {_first_line(e)}") from e
    except ray.exceptions.GetTimeoutError as e:
      raise WorkerDied(f"rollout actor {self.index} (pid {self.pid}) did not answer {method} "
                       f"within {timeout_s} s") from e


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def _last_line(e: BaseException) -> str:
  """The last line of `e`'s message: the original error under Ray's "The actor died because of an
  error raised in its creation task" and its traceback."""
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


# ---- connecting to Ray --------------------------------------------------------------------------


def check_address(address: str) -> Optional[str]:
  """Why `address` (rollout.ray_address) is malformed, or None: "" | "auto" | "[ray://]host:port"."""
  if address in ("", "auto"):
    return None
  hostport = address[len("ray://"):] if address.startswith("ray://") else address
  host, _, port = hostport.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    return (f"rollout.ray_address={address!r}: expected '' (start a local Ray instance in this "
            "process), 'auto' (the cluster `ray start` made on this node) or 'host:port' of a "
            "running cluster's head (e.g. '10.0.0.1:6379')")
  return None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
  """A TCP connect to host:port first: Ray itself retries an unreachable address for minutes."""
  hostport = address[len("ray://"):] if address.startswith("ray://") else address
  host, _, port = hostport.rpartition(":")
  try:
    socket.create_connection((host, int(port)), timeout=timeout_s).close()
  except OSError as e:
    raise ConnectionError(
        f"rollout.ray_address={address!r}: nothing answers at {host}:{port} ({e}). Start the "
        f"cluster's head there (`ray start --head --port={port}`), fix the address, or set "
        "rollout.ray_address='' to start a local Ray instance in this process") from None


def _use_cluster_token() -> None:
  """Token authentication for a cluster given by host:port: `ray start --head` (Ray 2.60) turns it
  on and writes ~/.ray/auth_token, but a driver connecting by address uses it only in token mode
  ("auto" finds the mode in the local session). Ray's own helper turns token mode on (refreshing
  its cached config) when a token is at hand and RAY_AUTH_MODE is unset."""
  try:
    from ray._private.authentication import authentication_token_setup as auth  # pylint: disable=g-import-not-at-top
    auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
  except (ImportError, AttributeError):  # another Ray version: RAY_AUTH_MODE=token by hand
    pass


def connect(address: str, num_cpus: Optional[float] = None) -> bool:
  """Connects this process to Ray; returns True when it started the instance (whoever started it
  shuts it down). Already connected: nothing changes (False).

  Args:
    address: "" starts a local instance here (`num_cpus` logical CPUs, no dashboard); "auto" or
      "[ray://]host:port" connects to a running cluster.
    num_cpus: the local instance's CPUs (None: Ray's count of this machine's).
  Raises:
    ValueError for a malformed address, ConnectionError (naming the fix) when nothing answers.
  """
  if ray.is_initialized():
    return False
  problem = check_address(address)
  if problem:
    raise ValueError(problem)
  # ray.init installs its own SIGTERM handler (exit at once); the run's StopSignals keeps its own.
  main = threading.current_thread() is threading.main_thread()
  sigterm = signal.getsignal(signal.SIGTERM) if main else None
  saved_cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
  worker_gpus = os.environ.get("JAXREPLAY_WORKER_GPUS", "")
  try:
    if address == "":
      kwargs = dict(address="local", include_dashboard=False)
      if num_cpus is not None:
        kwargs["num_cpus"] = int(math.ceil(num_cpus))
      if worker_gpus:  # launch restricted this process to the trainer's GPUs: Ray gets the others
        os.environ["CUDA_VISIBLE_DEVICES"] = worker_gpus
        kwargs["num_gpus"] = len(worker_gpus.split(","))
      ray.init(**kwargs)
      return True
    if address != "auto":
      _check_reachable(address)
      _use_cluster_token()
    try:
      ray.init(address=address)
    except ray.exceptions.AuthenticationError as e:
      raise ConnectionError(
          f"rollout.ray_address={address!r}: the cluster refused this process's Ray token "
          f"({_first_line(e)}). Ray >= 2.52 clusters started with `ray start --head` use token "
          "authentication: copy the head's ~/.ray/auth_token to this node (or set RAY_AUTH_TOKEN "
          "/ RAY_AUTH_TOKEN_PATH) and run with RAY_AUTH_MODE=token") from None
    except ConnectionError as e:
      raise ConnectionError(
          f"rollout.ray_address={address!r}: {e} Start a cluster (`ray start --head`) and pass its "
          "address, or set rollout.ray_address='' to start a local Ray instance in this process"
      ) from None
    return False
  finally:
    if worker_gpus and address == "":
      if saved_cuda is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
      else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved_cuda
    if main and sigterm is not None:
      signal.signal(signal.SIGTERM, sigterm)


def _actor_state(actor) -> tuple[Optional[str], Optional[int]]:
  """(state, restarts so far) of `actor` from Ray's actor table; (None, None) when the table cannot
  be read (a private Ray API: the caller then decides by the errors alone)."""
  try:
    from ray._private import state as ray_state  # pylint: disable=g-import-not-at-top
    info = ray_state.actors(actor_id=actor._actor_id.hex())  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return None, None
  if not info:
    return None, None
  return info.get("State"), info.get("NumRestarts")


# ---- the group ----------------------------------------------------------------------------------


class RayRolloutGroup:
  """W rollout actors in one placement group (see the module docstring).

  Args:
    spec: what each actor runs (`WorkerSpec`).
    num_workers: W, the bundles (one actor each).
    address: rollout.ray_address ("" starts a local instance with max(this machine's CPUs,
      W * num_cpus_per_worker) logical CPUs; on a GPU node `launch` left JAXREPLAY_WORKER_GPUS,
      which the local instance gets).
    num_cpus_per_worker, num_gpus_per_worker: each bundle's (and actor's) resources.
    strategy: the placement group's strategy (PACK | SPREAD | STRICT_PACK | STRICT_SPREAD).
    max_restarts: Ray restarts per actor (-1: unlimited).
    startup_timeout_s: how long `make_worker` waits for an actor to (re)start.
    placement_timeout_s: how long the placement group may take to be placed.
  """

  def __init__(self, spec: WorkerSpec, num_workers: int, *, address: str = "",
               num_cpus_per_worker: float = 1.0, num_gpus_per_worker: float = 0.0,
               strategy: str = "PACK", max_restarts: int = 5, startup_timeout_s: float = 300.0,
               placement_timeout_s: float = 120.0):
    if strategy not in STRATEGIES:
      raise ValueError(f"rollout.ray_placement_strategy={strategy!r}: expected one of {STRATEGIES}")
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1")
    if not num_cpus_per_worker > 0:
      raise ValueError(f"rollout.ray_num_cpus_per_worker={num_cpus_per_worker} must be > 0")
    if num_gpus_per_worker < 0:
      raise ValueError(f"num_gpus_per_worker={num_gpus_per_worker} must be >= 0 (resolve -1 first)")
    self.spec, self.num_workers = spec, int(num_workers)
    self.num_cpus, self.num_gpus = float(num_cpus_per_worker), float(num_gpus_per_worker)
    self.strategy, self.max_restarts = strategy, int(max_restarts)
    self.startup_timeout_s = float(startup_timeout_s)
    self._lock = threading.Lock()
    self._actors: list[Any] = [None] * self.num_workers
    self.infos: list[Optional[dict[str, Any]]] = [None] * self.num_workers
    self._closed = False
    start = time.perf_counter()
    self.owns_ray = connect(address, max(float(os.cpu_count() or 1),
                                         self.num_workers * self.num_cpus))
    self.connect_seconds = time.perf_counter() - start
    self.pg = None
    try:
      bundle = {"CPU": self.num_cpus}
      if self.num_gpus:
        bundle["GPU"] = self.num_gpus
      self.bundle = bundle
      self.pg = placement_group([dict(bundle)] * self.num_workers,
                                                    strategy=strategy)
      try:
        ray.get(self.pg.ready(), timeout=placement_timeout_s)
      except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {self.num_workers} rollout workers of {bundle} each (strategy "
            f"{strategy}) within {placement_timeout_s:.0f} s: the cluster has "
            f"{_resources(ray.cluster_resources())} ({_resources(ray.available_resources())} "
            "free). Lower rollout.num_workers or rollout.ray_num_cpus_per_worker / "
            "ray_num_gpus_per_worker, use rollout.ray_placement_strategy='PACK' (STRICT_SPREAD "
            "needs a node per worker), or add nodes") from None
    except BaseException:
      self._release()
      raise
    logging.info("Ray %s (%s): placement group of %d x %s (%s) in %.1f s; cluster %s",
                 ray.__version__, "started here" if self.owns_ray else "connected",
                 self.num_workers, bundle, strategy, time.perf_counter() - start,
                 _resources(ray.cluster_resources()))

  def make_worker(self, index: int, weights: Optional[Weights] = None) -> RayWorker:
    """A proxy of actor `index` holding `weights` (when given and loadable).

    The first call for `index` creates the actor; later ones attach to it once Ray has restarted
    it (waiting up to `startup_timeout_s`). Raises WorkerDied when the actor is dead for good,
    TimeoutError when it does not answer in time (the pool retries both, a bounded number of
    times). Weights its publisher has dropped meanwhile are not loaded (`StaleWeights`: the proxy
    then holds its actor's version; the pool loads its newest target next).
    """
    if not 0 <= index < self.num_workers:
      raise ValueError(f"worker index {index} outside the group's {self.num_workers} workers")
    start = time.perf_counter()
    with self._lock:
      if self._closed:
        raise RuntimeError("this RayRolloutGroup is closed")
      actor = self._actors[index]
      created = actor is None
      if created:
        actor = self._actors[index] = self._create(index)
    info = self._wait_alive(index, actor)
    worker = RayWorker(actor, index, info)
    previous = self.infos[index]
    self.infos[index] = info
    what = "started" if created else (
        "restarted by Ray" if previous and previous["pid"] != info["pid"] else "re-attached")
    logging.info("rollout actor %d %s: pid %d on node %s (%s, %s)%s, ready in %.1f s", index, what,
                 info["pid"], info["node_id"][:12], info["hostname"], info["node_ip"],
                 f", GPUs {','.join(info['gpu_ids'])}" if info["gpu_ids"] else "",
                 time.perf_counter() - start)
    if weights is not None and worker.policy_version != weights.version:
      try:
        worker.load_weights(weights)
      except StaleWeights:
        logging.info("rollout actor %d: version %d was superseded while it started; it loads the "
                     "newest next", index, weights.version)
    return worker

  def actor_pids(self) -> list[Optional[int]]:
    """The pid of each actor when its proxy was last attached (None: not made yet)."""
    return [None if i is None else i["pid"] for i in self.infos]

  def close(self) -> None:
    """Closes and kills the actors, removes the placement group, and shuts Ray down when this
    group started it."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      actors, self._actors = [a for a in self._actors if a is not None], []
    if actors:  # a clean engine shutdown (frees the segment files), then the processes
      refs = [a.close.remote() for a in actors]
      ray.wait(refs, num_returns=len(refs), timeout=10.0)
      for a in actors:
        try:
          ray.kill(a, no_restart=True)
        except Exception:  # pylint: disable=broad-except
          pass  # already gone
    self._release()

  def __enter__(self) -> "RayRolloutGroup":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- helpers ------------------------------------------------------------------------------

  def _release(self) -> None:
    if self.pg is not None:
      try:
        remove_placement_group(self.pg)
      except Exception:  # pylint: disable=broad-except
        pass
      self.pg = None
    if self.owns_ray and ray.is_initialized():
      ray.shutdown()

  def _runtime_env(self) -> dict[str, Any]:
    env = {str(k): str(v) for k, v in self.spec.env.items()}
    if os.path.isfile(os.path.join(_REPO_ROOT, "pyproject.toml")):
      # A checkout (not an installed package): this node, or a shared checkout on the others,
      # finds jaxreplay where the driver found it.
      env.setdefault("PYTHONPATH", f"{_REPO_ROOT}:${{PYTHONPATH}}")
    if self.spec.backend == "jax" and not self.num_gpus:
      env.setdefault("JAX_PLATFORMS", "cpu")
    return {"env_vars": env}

  def _create(self, index: int):
    options = dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                   max_restarts=self.max_restarts, max_task_retries=0,
                   runtime_env=self._runtime_env(),
                   scheduling_strategy=PlacementGroupSchedulingStrategy(
                       self.pg, placement_group_bundle_index=index))
    return _remote_actor_class().options(**options).remote(self.spec, index)

  def _wait_alive(self, index: int, actor) -> dict[str, Any]:
    """The actor's `stats()` once it answers; WorkerDied when it is dead for good."""
    deadline = time.monotonic() + self.startup_timeout_s
    ref = actor.stats.remote()  # queued until the constructor (or Ray's restart) has run
    unknown_since = None
    while True:
      try:
        return ray.get(ref, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
      except ray.exceptions.GetTimeoutError:
        pass  # still starting
      except ray.exceptions.ActorUnavailableError:
        ref = None  # restarting: ask again
      except _DEATH_ERRORS as e:
        state, restarts = _actor_state(actor)
        if "creation task" in str(e):  # its constructor raised: Ray does not restart that
          raise WorkerDied(f"rollout actor {index} failed to start: {_last_line(e)} (its log: Ray's "
                           "session logs, /tmp/ray/session_latest/logs)") from e
        if state == "DEAD" or (state is None and unknown_since is not None
                               and time.monotonic() - unknown_since > 10.0):
          raise WorkerDied(
              f"rollout actor {index} is dead for good after {restarts} Ray restarts "
              f"(rollout.ray_max_restarts={self.max_restarts}): {_first_line(e)}. Raise "
              "rollout.ray_max_restarts, or find why it dies in its log (Ray's session logs, "
              "/tmp/ray/session_latest/logs)") from e
        if state is None and unknown_since is None:
          unknown_since = time.monotonic()
        ref = None  # restarting (the table says so, or may lag): ask again
      if time.monotonic() > deadline:
        raise TimeoutError(f"rollout actor {index} did not answer within {self.startup_timeout_s:.0f} "
                           "s of (re)starting; a loaded machine or a large model needs longer")
      if ref is None:
        time.sleep(0.2)
        ref = actor.stats.remote()


@functools.cache
def _remote_actor_class():
  """`RolloutActor` as a Ray actor class (made once per process)."""
  return ray.remote(RolloutActor)


def _resources(resources: dict[str, float]) -> str:
  keys = [k for k in ("CPU", "GPU", "memory", "object_store_memory") if k in resources]
  return "{" + ", ".join(f"{k}: {resources[k] / 2**30:.1f} GiB" if "memory" in k else
                         f"{k}: {resources[k]:g}" for k in keys) + "}"


# ---- weights through the object store -----------------------------------------------------------


@dataclasses.dataclass
class StoredWeights:
  """One version in Ray's object store. `ref` is the `ray.ObjectRef` of the payload, None once
  the publisher dropped it (only the newest `keep` versions stay referenced)."""
  version: int
  ref: Any
  nbytes: int
  put_s: float


@dataclasses.dataclass
class PutRecord:
  """One publish: version, payload bytes, the trainer's stall (device -> host copy) and the
  background put (HF layout + `ray.put`) [s]."""
  version: int
  nbytes: int
  stall_s: float
  put_s: float = float("nan")  # NaN until the object is stored


class ObjectStorePublisher:
  """Publishes successive parameter versions into Ray's object store (see the module docstring).

  Args:
    cfg: the architecture. form: "params" (the numpy parameter pytree, for JAX-sampler actors) or
      "hf" (the HF-named, HF-layout state dict, for vLLM actors).
    dtype: the payload's dtype ("float32" | "bfloat16" | "float16"; cast on device before the host
      copy); None keeps the params' own (the JAX samplers' in-process behaviour).
    keep: the newest versions whose objects stay referenced (>= 1; a worker may be about to load
      version v while v + 1 is stored, so 2 or more for a pool).
  """

  def __init__(self, cfg, form: str, dtype: Optional[str] = None, keep: int = 3):
    if form not in ("params", "hf"):
      raise ValueError(f"form={form!r}: expected 'params' (JAX samplers) or 'hf' (vLLM engines)")
    if dtype is not None and dtype not in shm_weights.DTYPES:
      raise ValueError(f"dtype={dtype!r}: expected one of {sorted(shm_weights.DTYPES)} or None")
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1")
    if not ray.is_initialized():
      raise RuntimeError("ObjectStorePublisher needs Ray: connect first (ray_workers.connect, or "
                         "a RayRolloutGroup)")
    self.cfg, self.form, self.dtype, self.keep = cfg, form, dtype, int(keep)
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray-publisher")
    self._lock = threading.Lock()
    self._stored: collections.deque[StoredWeights] = collections.deque()
    self._last_version: Optional[int] = None
    self.history: list[PutRecord] = []
    self._closed = False

  @property
  def latest(self) -> Optional[PutRecord]:
    return self.history[-1] if self.history else None

  def publish(self, params: Any, version: int) -> Weights:
    """Hands `params` over as `version`; returns at once with `Weights(object_ref=future,
    ready=future)` (the future's result: the `StoredWeights`). `params` (jax arrays, fully
    addressable, or numpy) may be donated as soon as this returns."""
    import jax  # pylint: disable=g-import-not-at-top
    version = int(version)
    with self._lock:
      if self._closed:
        raise RuntimeError("this ObjectStorePublisher is closed")
      if self._last_version is not None and version <= self._last_version:
        raise ValueError(f"version {version} is not newer than the last published version "
                         f"{self._last_version}; versions must increase")
      start = time.perf_counter()
      leaves, treedef = jax.tree_util.tree_flatten(params)
      host = _copy_to_host(leaves, self.dtype)
      record = PutRecord(version, sum(x.nbytes for x in host), time.perf_counter() - start)
      future = self._executor.submit(self._put, treedef, host, version, record)
      self._last_version = version
      self.history.append(record)
    return Weights(version=version, cfg=self.cfg, object_ref=future, ready=future)

  def close(self) -> None:
    """Finishes pending puts and drops every reference (Ray frees the objects)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._executor.shutdown(wait=True)
    with self._lock:
      for stored in self._stored:
        stored.ref = None
      self._stored.clear()

  def __enter__(self) -> "ObjectStorePublisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _put(self, treedef, host: list[np.ndarray], version: int, record: PutRecord) -> StoredWeights:
    import jax  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    tree = jax.tree_util.tree_unflatten(treedef, host)
    payload = tree if self.form == "params" else _hf_state_dict(self.cfg, tree)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(payload))
    ref = ray.put(payload)
    del payload, tree, host
    record.put_s = time.perf_counter() - start
    stored = StoredWeights(version, ref, nbytes, record.put_s)
    with self._lock:
      self._stored.append(stored)
      while len(self._stored) > self.keep:
        self._stored.popleft().ref = None
    return stored


def _copy_to_host(leaves: list[Any], dtype: Optional[str]) -> list[np.ndarray]:
  """Host copies of `leaves` (cast on device to `dtype` first), all transfers in flight at once."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if dtype is not None:
    target = jnp.dtype(dtype)
    leaves = [x.astype(target) if isinstance(x, jax.Array) and x.dtype != target else x
              for x in leaves]
  for x in leaves:
    if isinstance(x, jax.Array):
      x.copy_to_host_async()
  out = []
  for x in leaves:
    host = np.array(x)  # a copy: the train step may donate the device buffer next
    if dtype is not None and host.dtype != shm_weights.DTYPES[dtype]:
      host = host.astype(shm_weights.DTYPES[dtype])
    out.append(host)
  return out


def _hf_state_dict(cfg, params: Any) -> dict[str, np.ndarray]:
  """{HF name: HF-layout array} of host `params` (HF order; transposes in slabs, as the segment
  writer does; padding and layer stacking undone)."""
  from jaxreplay.models import hf_io  # pylint: disable=g-import-not-at-top
  out = {}
  for name, shape, transpose, source in hf_io.hf_sources(cfg, params):
    src = source()
    dst = np.empty(shape, src.dtype)
    shm_weights.default_copy(dst, src, transpose)
    out[name] = dst
  return out
