"""Rollout workers as Ray actors (rollout.placement="ray"), the driver's side: connecting to Ray,
the placement group, and the proxies the `WorkerPool` drives. Declared resources, started and
restarted by Ray, weights through Ray's object store.

Only `workers.RolloutBackend` imports this module (and `build` to validate the keys), and only when
rollout.placement is "ray"; the no-Ray default stays `WorkerPool` over in-process `JaxSampler`s or
`VllmWorkerProcess`es. The parts:
  - `actor.RolloutActor` / `WorkerSpec`: what runs in an actor (a JAX sampler or a vLLM engine);
  - `publisher.ObjectStorePublisher`: one object per version in Ray's object store;
  - here, `RayWorker`: the driver's proxy of an actor, a `RolloutWorker`; Ray's actor errors
    (`RayActorError`: died, unavailable, ...) become `WorkerDied`, so a `WorkerPool` drops the
    in-flight request and calls `make_worker(i)` again;
  - here, `RayRolloutGroup`: connects to Ray (or starts a local instance, `connect`), reserves ONE
    placement group of W bundles {"CPU": c, "GPU": g} with the configured strategy, and creates
    actor i in bundle i (`max_restarts`, `max_task_retries=0`: a request in flight when its actor
    dies fails, it is never re-run behind the pool's back). `make_worker(i, weights)` makes actor i
    on first use; later calls (the pool replacing a dead worker) attach a new proxy to the SAME
    actor once Ray has restarted it and bring it to `weights`: Ray's restart is the respawn. An
    actor dead for good (restarts exhausted, or its constructor failed) raises `WorkerDied`.
The actor and publisher names are re-exported here.

Not built: GPU NCCL broadcast from the trainer to the engines (no GPU to test it here); GPU engines
get the object-store copy (a host round trip). vLLM tensor parallelism inside one actor (bundles of
tp GPUs) is untested. Every node must import jaxreplay (installed there, or a shared checkout: the
actors' PYTHONPATH starts with the driver's jaxreplay checkout).
"""
from __future__ import annotations

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

from jaxreplay.rollout import backend_table
from jaxreplay.rollout.base import Group, SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.ray.actor import RolloutActor, WorkerSpec
from jaxreplay.rollout.ray.publisher import (ObjectStorePublisher, PutRecord,
                                             StoredWeights, stored_weights)
from jaxreplay.rollout.base import StaleWeights

__all__ = ["STRATEGIES", "ObjectStorePublisher", "PutRecord", "RayRolloutGroup", "RayWorker",
           "RolloutActor", "StoredWeights", "WorkerSpec", "check_address", "connect",
           "stored_weights"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray errors that mean "this worker's process (or node) is gone", not a bug in the request.
_DEATH_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# ---- the driver's proxy -------------------------------------------------------------------------



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
  def call_count(self) -> Optional[int]:
    """Actors of samplers that count their calls (the JAX sampler's noise stream): generate calls
    so far (`JaxSampler.call_count`); None for other actors (`RolloutWorker.call_count`)."""
    if not self.info.get("counts_calls"):
      return None
    return self._call("get_call_count", (), 60.0)

  @call_count.setter
  def call_count(self, value: int) -> None:
    if not self.info.get("counts_calls"):
      raise ValueError(f"call_count={value}: only actors of samplers that count their calls have it "
                       f"(this actor runs {self.info.get('backend')!r})")
    self._call("set_call_count", (int(value),), 60.0)

  def close(self) -> None:
    """Detaches this proxy; the actor lives on in its group."""
    self._actor = None

  def kill(self) -> None:
    """Kills the actor's process now (Ray restarts it while restarts are left)."""
    actor = self._actor
    if actor is not None:
      ray.kill(actor, no_restart=False)

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
    record = backend_table.BACKENDS.get(self.spec.backend)  # unknown: the actor's start says so
    if record is not None and not self.num_gpus:  # e.g. a JAX sampler without a GPU: JAX on CPU
      for key, value in record.actor_env_without_gpus.items():
        env.setdefault(key, value)
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

