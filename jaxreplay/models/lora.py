"""LoRA adapters over the functional parameter pytree: their math, their layout and PEFT's names.

An adapter is a separate pytree, in the kernels' [in, out] convention and stacked over layers like
them (`params["layers"][target]` is [L, in, out]):
```
adapters = {target: {"a": [L, in, r], "b": [L, r, out]}}      target in TARGETS (e.g. "q_proj")
y = x @ W + scale * (x @ a) @ b                               scale = alpha / r (rsLoRA: alpha / sqrt(r))
```
`init_adapters` follows PEFT's default (`init_lora_weights=True`): a ~ U(+-1/sqrt(in)) (kaiming-
uniform with a=sqrt(5)), b = 0, so a fresh adapter is exactly the base model.

`attach(params, adapters, spec)` returns the params with each targeted kernel replaced by a
`LoraKernel(w, a, b, scale)` pytree node: every model function (`apply`, `token_logprobs`,
`prefill`, `decode_step`) runs the adapted model unchanged, because the layer scan slices the
node's three arrays per layer and `transformer._dense` computes the low-rank term. The base is not
copied (the trainer's frozen base and a JAX sampler share it). `merge` computes W + scale * a @ b
(exports, references).

PEFT's format (what `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read): adapter_config.json
(`peft_config`) and adapter_model.safetensors with, per layer i and target t,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_A.weight` [r, in] = a[i].T and
`...lora_B.weight` [out, r] = b[i].T (names from `layout.RULES`). `save_peft` / `load_peft`.

This module imports only `layout` of jaxreplay (transformer.py imports it for `LoraKernel`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import layout

Params = dict[str, Any]

# The per-layer linear kernels of the layout table: what an adapter may target (HF module names).
TARGETS: tuple[str, ...] = tuple(r.path[-1] for r in layout.RULES if r.per_layer and r.transpose)
# vLLM's allowed `max_lora_rank` values (vllm.config.lora, 0.32); an adapter of rank r runs in an
# engine with the smallest of them >= r.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTYPES = ("float32", "bfloat16")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """rank r >= 1, alpha > 0, the targeted kernels, rsLoRA scaling, the adapters' dtype (hashable)."""
  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS
  rslora: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    problems = spec_errors(self.rank, self.alpha, self.targets, self.dtype)
    if problems:
      raise ValueError("; ".join(problems))

  @property
  def scale(self) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's and vLLM's `scaling`)."""
    return float(self.alpha) / (math.sqrt(self.rank) if self.rslora else self.rank)


def spec_errors(rank, alpha, targets, dtype) -> list[str]:
  """What is wrong with these model.lora_* values, each naming the key and the fix."""
  errors = []
  if not isinstance(rank, (int, np.integer)) or rank < 1:
    errors.append(f"model.lora_rank={rank!r} must be an integer >= 1 (0 turns LoRA off)")
  if not alpha > 0:
    errors.append(f"model.lora_alpha={alpha!r} must be > 0 (the adapter's scale is alpha / rank)")
  targets = tuple(targets)
  unknown = [t for t in targets if t not in TARGETS]
  if not targets or unknown:
    errors.append(f"model.lora_targets={targets!r}: {'unknown ' + str(unknown) if unknown else 'empty'}"
                  f"; choose from the model's linear kernels {TARGETS}")
  if len(set(targets)) != len(targets):
    errors.append(f"model.lora_targets={targets!r} names a kernel twice")
  if dtype not in DTYPES:
    errors.append(f"model.lora_dtype={dtype!r}: expected one of {DTYPES}")
  return errors


def spec_from_config(m) -> Optional[LoraSpec]:
  """The model section's LoRA (model.lora_rank, lora_alpha, lora_targets, lora_rslora,
  lora_dtype), or None when model.lora_rank is 0 (off)."""
  rank = int(m.get("lora_rank", 0))
  if rank == 0:
    return None
  return LoraSpec(rank=rank, alpha=float(m.lora_alpha), targets=tuple(m.lora_targets),
                  rslora=bool(m.lora_rslora), dtype=str(m.lora_dtype))


def vllm_max_lora_rank(rank: int) -> int:
  """vLLM's `max_lora_rank` for an adapter of rank `rank`: the smallest allowed value >= rank."""
  for allowed in VLLM_RANKS:
    if allowed >= rank:
      return allowed
  raise ValueError(f"model.lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]} "
                   f"(max_lora_rank in {VLLM_RANKS}); lower model.lora_rank or use "
                   "rollout.backend='jax'")


# ---- the adapted kernel -------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class LoraKernel:
  """A frozen kernel w [..., in, out] with its adapter a [..., in, r], b [..., r, out] and scale
  (static: pytree aux data). `transformer._dense` computes x @ w + scale * (x @ a) @ b.

  Behaves as w where the layout's padding helpers look: `shape` is w's, and indexing (the
  trainer's padded storage sliced back to the logical shape, `layout.unpad_layer`) slices w and
  the matching dimensions of a (in) and b (out); adapters themselves are never padded."""

  def __init__(self, w, a, b, scale: float):
    self.w, self.a, self.b, self.scale = w, a, b, scale

  def tree_flatten(self):
    return (self.w, self.a, self.b), self.scale

  @classmethod
  def tree_unflatten(cls, scale, children):
    return cls(*children, scale)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.w.shape)

  def __getitem__(self, index):
    index = tuple(index)
    a_index = index[:-1] + (slice(None),)
    b_index = index[:-2] + (slice(None), index[-1])
    return LoraKernel(self.w[index], self.a[a_index], self.b[b_index], self.scale)


# ---- shapes, init, attach, merge ----------------------------------------------------------------

def _kernel_rule(target: str) -> layout.Rule:
  for r in layout.RULES:
    if r.per_layer and r.transpose and r.path[-1] == target:
      return r
  raise ValueError(f"LoRA target {target!r} is not a linear kernel of the model; choose from "
                   f"{TARGETS} (config model.lora_targets)")


def adapter_shapes(cfg, spec: LoraSpec) -> dict[str, dict[str, tuple[int, ...]]]:
  """{target: {"a": (L, in, r), "b": (L, r, out)}} from the kernels' layout rules."""
  out = {}
  for t in spec.targets:
    num_layers, n_in, n_out = _kernel_rule(t).jax_shape(cfg)
    out[t] = {"a": (num_layers, n_in, spec.rank), "b": (num_layers, spec.rank, n_out)}
  return out


def init_adapters(cfg, spec: LoraSpec, rng: jax.Array) -> Params:
  """PEFT's default init in spec.dtype: a ~ U(+-1/sqrt(in)), b = 0 (a no-op adapter). `rng` is
  split once per target in sorted order. Works under `jax.eval_shape`."""
  shapes = adapter_shapes(cfg, spec)
  dtype = jnp.dtype(spec.dtype)
  keys = jax.random.split(rng, len(shapes))
  out = {}
  for key, t in zip(keys, sorted(shapes)):
    s = shapes[t]
    bound = 1.0 / math.sqrt(s["a"][1])
    out[t] = {"a": jax.random.uniform(key, s["a"], jnp.float32, -bound, bound).astype(dtype),
              "b": jnp.zeros(s["b"], dtype)}
  return out


def check_adapters(cfg, spec: LoraSpec, adapters: Params) -> None:
  """ValueError naming the first target or shape that does not match `spec` on `cfg`."""
  want = adapter_shapes(cfg, spec)
  if set(adapters) != set(want):
    raise ValueError(f"adapters target {sorted(adapters)}, expected {sorted(want)} "
                     "(config model.lora_targets)")
  for t, shapes in want.items():
    for k, shape in shapes.items():
      got = tuple(np.shape(adapters[t][k]))
      if got != shape:
        raise ValueError(f"adapter {t}/{k} has shape {got}, expected {shape} (rank "
                         f"{spec.rank}; config model.lora_rank)")


def attach(params: Params, adapters: Params, spec: LoraSpec) -> Params:
  """`params` with each targeted kernel a `LoraKernel` (no copy of the base; see module doc)."""
  layers = dict(params["layers"])
  for t, ab in adapters.items():
    layers[t] = LoraKernel(layers[t], ab["a"], ab["b"], spec.scale)
  return {**params, "layers": layers}


def merge(cfg, params: Params, adapters: Params, spec: LoraSpec) -> Params:
  """The merged params (logical shapes, each kernel in its own dtype): W + scale * a @ b, computed
  in float32. numpy in, numpy out (exports); jax arrays in, jax arrays out."""
  params = layout.unpad(cfg, params)
  layers = dict(params["layers"])
  for t, ab in adapters.items():
    w = layers[t]
    xp = jnp if isinstance(w, jax.Array) else np
    a, b = (xp.asarray(ab[k]).astype(xp.float32) for k in ("a", "b"))
    delta = xp.einsum("lir,lro->lio", a, b) * xp.float32(spec.scale)
    layers[t] = (xp.asarray(w).astype(xp.float32) + delta).astype(w.dtype)
  return {**params, "layers": layers}


def num_params(cfg, spec: LoraSpec) -> int:
  """Adapter parameters (a and b of every target and layer)."""
  return sum(math.prod(s) for shapes in adapter_shapes(cfg, spec).values() for s in shapes.values())


# ---- PEFT's format ------------------------------------------------------------------------------

def peft_name(target: str, layer: int, which: str) -> str:
  """PEFT's tensor name of `which` ("A" or "B") of `target` in `layer`."""
  hf = _kernel_rule(target).hf_name.format(i=layer)           # model.layers.{i}.<module>.<t>.weight
  return PEFT_PREFIX + hf[:-len(".weight")] + f".lora_{which}.weight"


def to_peft_tensors(cfg, adapters: Params, dtype: Optional[str] = None) -> dict[str, np.ndarray]:
  """{PEFT name: numpy tensor} (lora_A [r, in] = a[i].T, lora_B [out, r] = b[i].T), in the
  adapters' dtype or `dtype`; layers in order, A before B."""
  out = {}
  host = {t: {k: np.asarray(v) for k, v in ab.items()} for t, ab in adapters.items()}
  for i in range(cfg.num_hidden_layers):
    for t in TARGETS:
      if t not in host:
        continue
      for which, key in (("A", "a"), ("B", "b")):
        x = np.ascontiguousarray(host[t][key][i].T)
        out[peft_name(t, i, which)] = x if dtype is None else x.astype(jnp.dtype(dtype))
  return out


def from_peft_tensors(cfg, tensors: dict[str, Any], targets: tuple[str, ...],
                      dtype=None) -> Params:
  """The adapter pytree (numpy) of PEFT-named tensors; KeyError naming a missing tensor."""
  out = {}
  for t in targets:
    a = [np.asarray(tensors[peft_name(t, i, "A")]).T for i in range(cfg.num_hidden_layers)]
    b = [np.asarray(tensors[peft_name(t, i, "B")]).T for i in range(cfg.num_hidden_layers)]
    out[t] = {"a": np.stack(a), "b": np.stack(b)}
    if dtype is not None:
      out[t] = {k: v.astype(jnp.dtype(dtype)) for k, v in out[t].items()}
  return out


def peft_config(spec: LoraSpec, base_model_name_or_path: str = "") -> dict[str, Any]:
  """adapter_config.json of `spec` (plain LoRA: no dropout, bias, DoRA or modules_to_save)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank),
          "lora_alpha": float(spec.alpha), "target_modules": list(spec.targets),
          "use_rslora": bool(spec.rslora), "lora_dropout": 0.0, "bias": "none",
          "fan_in_fan_out": False, "use_dora": False, "init_lora_weights": True,
          "modules_to_save": None, "inference_mode": True,
          "base_model_name_or_path": base_model_name_or_path or None}


def write_peft(directory: str, cfg, spec: LoraSpec, adapters: Params,
               base_model_name_or_path: str = "", dtype: Optional[str] = None) -> int:
  """Writes adapter_config.json and adapter_model.safetensors into the existing `directory`;
  returns the tensor bytes written."""
  from jaxreplay.models import safetensors_io  # pylint: disable=g-import-not-at-top
  tensors = to_peft_tensors(cfg, adapters, dtype)
  plan = [(name, x.shape, x.dtype, (lambda x=x: x)) for name, x in tensors.items()]
  safetensors_io.write_safetensors(os.path.join(directory, ADAPTER_WEIGHTS), plan)
  with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
    json.dump(peft_config(spec, base_model_name_or_path), f, indent=2)
  return sum(x.nbytes for x in tensors.values())


def save_peft(out_dir: str, cfg, spec: LoraSpec, adapters: Params,
              base_model_name_or_path: str = "", dtype: Optional[str] = None) -> None:
  """An adapter directory in PEFT's format at `out_dir`, written under a temporary name and
  swapped into place (replacing an existing one)."""
  from jaxreplay.models import safetensors_io  # pylint: disable=g-import-not-at-top
  with safetensors_io.staged_dir(out_dir) as tmp:
    write_peft(tmp, cfg, spec, adapters, base_model_name_or_path, dtype)


def load_peft(path: str, cfg) -> tuple[LoraSpec, Params]:
  """(spec, numpy adapters) of a PEFT adapter directory (plain LoRA on TARGETS kernels)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  with open(os.path.join(path, ADAPTER_CONFIG)) as f:
    conf = json.load(f)
  if conf.get("peft_type", "LORA") != "LORA" or conf.get("use_dora"):
    raise ValueError(f"{path}: only plain LoRA adapters load (peft_type LORA, no DoRA)")
  targets = conf["target_modules"]
  targets = tuple(t for t in TARGETS if t in targets) if isinstance(targets, list) else ()
  tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
  dtype = str(next(iter(tensors.values())).dtype)
  spec = LoraSpec(rank=int(conf["r"]), alpha=float(conf["lora_alpha"]), targets=targets,
                  rslora=bool(conf.get("use_rslora", False)),
                  dtype=dtype if dtype in DTYPES else "float32")
  return spec, from_peft_tensors(cfg, tensors, targets)
