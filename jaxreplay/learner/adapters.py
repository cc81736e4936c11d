"""LoRA training: the frozen base beside a train state whose params are the adapters.

`FrozenBase` holds what the trainer needs besides its `TrainState`: the base params on the trainer
mesh (sharded by `sharding.PARAM_RULES`, stored padded where the mesh does not divide, in
model.param_dtype, e.g. bfloat16), the `models.lora.LoraSpec`, and the base's identity (model.path
and a sha256 of its content). `init_adapter_state` makes the `TrainState` of the adapters: params
= `{target: {"a", "b"}}`, AdamW state over them only; `trainer.make_train_step(..., lora=base)`
and `make_logprob_fn(..., lora=base)` bind the base as a non-donated argument of the jitted step.

Sharding: the adapters and their optimizer state are replicated (the adapter rule of
`sharding.PARAM_RULES`). They are small
(Qwen3-8B at rank 16 on all seven kernels: 43.6M parameters, 0.5% of the base; f32 adapters + Adam
+ gradient = 0.65 GiB per device), a rank of 8-64 is no multiple of a mesh axis, and replication
keeps x @ a and (x @ a) @ b local to each device's rows: the only collective they add is the
gradient's all-reduce over the batch axes (two adapter-sized transfers per step, against the
base's per-layer all-gathers that FSDP already does).

Checkpoints hold the train state (adapters, their optimizer state, step, rng) and, in the host
state, `FrozenBase.identity()`: the base's path and content hash, never the base itself.
`check_resume` refuses a resume on another base (different content) with the fix in the message.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import time
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxreplay.infra import sharding
from jaxreplay.learner.trainer import TrainState, _raw_key
from jaxreplay.models import lora as lora_lib
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig

_HASH_CHUNK = 16 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class FrozenBase:
  """The frozen base of a LoRA run (see the module docstring).

  spec: the adapters' `LoraSpec`. params: the base pytree on the trainer mesh (storage shapes),
  never donated or updated. shardings: its NamedShardings. path: model.path ("" for a preset
  initialised from the seed). sha256: the content hash of the base (`base_fingerprint`).
  """
  spec: lora_lib.LoraSpec
  params: Any
  shardings: Any
  path: str
  sha256: str

  def model_params(self, adapters: Any) -> Any:
    """The policy's params: the base with `adapters` attached (`lora.attach`, no copy)."""
    return lora_lib.attach(self.params, adapters, self.spec)

  def identity(self) -> dict[str, Any]:
    """What a checkpoint records of the base and the adapters' shape (host state "lora")."""
    s = self.spec
    return {"base_path": self.path, "base_sha256": self.sha256, "rank": int(s.rank),
            "alpha": float(s.alpha), "targets": list(s.targets), "rslora": bool(s.rslora)}


def place_base(cfg: ModelConfig, mesh: Mesh, params: Any = None, rng: Optional[jax.Array] = None
               ) -> tuple[Any, Any]:
  """(base params on `mesh` in their storage shapes, their shardings). `params`: a loaded pytree
  (e.g. `hf_io.load_hf(..., shardings=...)`, already placed: used as is), or None to initialise
  from `rng` (`transformer.init_params`, created sharded)."""
  logical = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  storage = sharding.storage_shapes(logical, mesh)
  shardings = sharding.param_shardings(storage, mesh)

  def pad(p):
    return jax.tree.map(lambda x, s: sharding.pad_to(x, s.shape), p, storage)

  if params is None:
    key = jax.random.PRNGKey(0) if rng is None else _raw_key(rng)
    return jax.jit(lambda k: pad(transformer.init_params(cfg, k)), out_shardings=shardings)(key), \
        shardings
  if jax.tree.structure(params) != jax.tree.structure(logical):
    raise ValueError("base params do not match the model config's pytree "
                     f"({jax.tree.structure(logical)})")
  stored = jax.tree.map(lambda x, s: tuple(np.shape(x)) == tuple(s.shape), params, storage)
  if all(jax.tree.leaves(stored)):
    return jax.device_put(params, shardings), shardings
  return jax.jit(pad, out_shardings=shardings)(params), shardings


def base_fingerprint(path: str = "", params: Any = None) -> str:
  """sha256 of the base's content: of config.json and the safetensors files (and index) of the
  HF directory `path` (names and bytes, sorted; ~1-2 GB/s), else of `params` (a preset base: each
  leaf's path, shape, dtype and bytes)."""
  digest = hashlib.sha256()
  start = time.perf_counter()
  if path:
    names = sorted({os.path.relpath(f, path) for pattern in ("config.json", "*.safetensors",
                                                             "*.safetensors.index.json")
                    for f in glob.glob(os.path.join(glob.escape(path), pattern))})
    if not any(n.endswith(".safetensors") for n in names):
      raise FileNotFoundError(f"model.path={path!r} holds no *.safetensors: no base to hash")
    for name in names:
      digest.update(name.encode() + b"\0")
      with open(os.path.join(path, name), "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
          digest.update(chunk)
  else:
    for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      x = np.asarray(jax.device_get(leaf))
      digest.update(f"{sharding.path_str(leaf_path)}:{x.shape}:{x.dtype}".encode())
      digest.update(np.ascontiguousarray(x).view(np.uint8).data)
  logging.info("LoRA base %s: sha256 %s (%.1f s)", path or "(preset)", digest.hexdigest()[:16],
               time.perf_counter() - start)
  return digest.hexdigest()


def frozen_base(cfg: ModelConfig, spec: lora_lib.LoraSpec, mesh: Mesh, params: Any = None,
                rng: Optional[jax.Array] = None, path: str = "") -> FrozenBase:
  """The `FrozenBase` of a run: `params` (loaded from `path`) or a preset base from `rng`, placed
  on `mesh`, with its fingerprint."""
  placed, shardings = place_base(cfg, mesh, params, rng)
  sha = base_fingerprint(path) if path else base_fingerprint(params=placed)
  return FrozenBase(spec=spec, params=placed, shardings=shardings, path=path, sha256=sha)


def init_adapter_state(cfg: ModelConfig, spec: lora_lib.LoraSpec,
                       optimizer: optax.GradientTransformation, rng: jax.Array,
                       mesh: Mesh) -> TrainState:
  """The TrainState of LoRA training at step 0, created replicated on `mesh`: params = fresh
  adapters (`lora.init_adapters`, from a split of `rng` as `init_train_state` splits it), AdamW
  state over them; no ref_params (the KL reference is the base)."""
  init_rng, state_rng = jax.random.split(_raw_key(rng))

  def build(init_rng, state_rng):
    adapters = lora_lib.init_adapters(cfg, spec, init_rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=adapters,
                      opt_state=optimizer.init(adapters), rng=state_rng)

  abstract = jax.eval_shape(build, init_rng, state_rng)
  shardings = sharding.tree_shardings(abstract, mesh)
  return jax.jit(build, out_shardings=shardings)(init_rng, state_rng)


def check_resume(saved: Optional[dict], base: FrozenBase, workdir: str = "") -> None:
  """Raises ValueError when the checkpoint's LoRA record (`FrozenBase.identity()` in its host
  state) names another base (content) or adapter shape than this run's."""
  where = f" in {workdir}" if workdir else ""
  now = base.identity()
  if saved is None:
    raise ValueError(f"the checkpoint{where} has no LoRA record: it was written without LoRA "
                     "(model.lora_rank=0). Resume it with model.lora_rank=0, or start a new workdir")
  if saved.get("base_sha256") != now["base_sha256"]:
    raise ValueError(
        f"resuming the LoRA adapters{where} on another base model: the checkpoint's adapters were "
        f"trained on {saved.get('base_path') or '(a preset base)'} (sha256 "
        f"{str(saved.get('base_sha256'))[:16]}...), this run's base is {now['base_path'] or '(a preset base)'} "
        f"(sha256 {now['base_sha256'][:16]}...). Set model.path to the original base, or start a "
        "new workdir")
  changed = [f"{k} {saved.get(k)} -> {now[k]}" for k in ("rank", "alpha", "targets", "rslora")
             if saved.get(k) != now[k]]
  if changed:
    raise ValueError(f"resuming the LoRA adapters{where} with changed {', '.join(changed)} "
                     "(config model.lora_*): resume with the original values, or start a new workdir")
  if saved.get("base_path") != now["base_path"]:
    logging.info("LoRA base moved: %s -> %s (same content)", saved.get("base_path"),
                 now["base_path"])
