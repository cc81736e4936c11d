"""Exact conversion between the jaxreplay parameter pytree and Hugging Face checkpoints.

Names, shapes and layouts come from the table `layout.RULES` (HF linear weights are [out, in],
jaxreplay kernels [in, out]; per-layer HF tensors `model.layers.{i}.<name>` are stacked on axis 0 of
`params["layers"][<leaf>]`); both directions (`to_hf_state_dict` / `save_hf` and
`from_hf_state_dict` / `load_hf`) read it. The files themselves (safetensors, index, tokenizer) are
`safetensors_io`'s. The names callers import from here (`RULES`, `param_shapes`, `hf_names`,
`TOKENIZER_FILES`, ...) are re-exported from those two modules.

Tied embeddings. A tied model (`tie_word_embeddings=True`) has no `params["lm_head"]` and `save_hf`
writes no `lm_head.weight` (as transformers does). On load, an `lm_head.weight` in a tied checkpoint is
ignored when it equals `model.embed_tokens.weight` bit for bit (some exporters write both) and is an
error otherwise (the checkpoint is then untied and config.json is wrong).

Memory. `save_hf` converts and writes one tensor at a time (a streaming safetensors writer), so host
memory holds one HF tensor beyond the params. `load_hf` assembles one JAX leaf at a time; with
`shardings` each device's slice is read from the memory-mapped files by `jax.make_array_from_callback`,
so a leaf is never materialised whole on host unless its sharding replicates it.

Older checkpoints may hold `...rotary_emb.inv_freq` buffers; they are derived from config.json and are
ignored on load.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from typing import Any, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.infra import sharding as sharding_lib
from jaxreplay.models import layout
from jaxreplay.models import safetensors_io
from jaxreplay.models.config import ModelConfig

Params = dict[str, Any]

# Re-exported: callers and tests reach the layout and the tokenizer file list through this module.
Rule = layout.Rule
RULES = layout.RULES
rules_for = layout.rules_for
hf_names = layout.hf_names
param_shapes = layout.param_shapes
check_params = layout.check_params
TOKENIZER_FILES = safetensors_io.TOKENIZER_FILES

_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- JAX -> HF --------------------------------------------------------------------------------


def _jax_layout_view(leaf, rule: layout.Rule, layer: Optional[int],
                     logical_shape: Optional[tuple[int, ...]] = None) -> np.ndarray:
  """One tensor of a JAX leaf as numpy, still in JAX layout ([in, out] for kernels): the layer's
  slice, and `logical_shape` (JAX layout, without the layer axis) slices a padded leaf back. A view
  of `leaf` when it is numpy (no copy); a device slice + transfer when it is a jax.Array."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    raise ValueError(f"leaf {'/'.join(rule.path)!r} is not fully addressable from this process; "
                     "gather it (e.g. with jax.experimental.multihost_utils) before saving")
  x = np.asarray(leaf if layer is None else leaf[layer])
  if logical_shape is not None:  # a leaf stored padded by the trainer (`layout.unpad`)
    x = x[tuple(slice(0, n) for n in logical_shape)]
  return x


def _host_tensor(leaf, rule: layout.Rule, layer: Optional[int], dtype,
                 logical_shape: Optional[tuple[int, ...]] = None) -> np.ndarray:
  """One HF tensor (HF layout, C-contiguous numpy) out of a JAX leaf; a device slice when jax."""
  x = _jax_layout_view(leaf, rule, layer, logical_shape)
  if rule.transpose:
    x = x.T
  if dtype is not None:
    x = x.astype(dtype, copy=False)
  return np.ascontiguousarray(x)


def _logical_shape(cfg: ModelConfig, leaf, rule: layout.Rule, layer: Optional[int]):
  want = rule.jax_shape(cfg)
  if tuple(leaf.shape) == want:
    return None
  return want[1:] if layer is not None else want


def hf_sources(cfg: ModelConfig, params: Params) -> list[tuple[str, tuple[int, ...], bool, Any]]:
  """(HF name, HF shape, transpose, source) per HF tensor, in HF state-dict order, from the table.

  `source()` is the tensor in JAX layout (numpy; a view of `params` when they are numpy, so a
  caller can write `source().T` straight into its own buffer, e.g. shared memory, without an
  intermediate copy); `transpose` says the HF tensor is its transpose ([out, in] of an [in, out]
  kernel). Padding and layer stacking are undone as for `save_hf`.
  """
  layout.check_params(cfg, params, allow_padding=True)
  out = []
  for name, rule, layer in layout.entries(cfg):
    leaf = layout.get_leaf(params, rule.path)
    logical = _logical_shape(cfg, leaf, rule, layer)
    out.append((name, tuple(rule.hf_shape(cfg)), bool(rule.transpose),
                lambda leaf=leaf, rule=rule, layer=layer, logical=logical:
                _jax_layout_view(leaf, rule, layer, logical)))
  return out


def _plan(cfg: ModelConfig, params: Params, dtype=None):
  """(HF name, HF shape, numpy dtype, producer) per tensor; checks params first."""
  layout.check_params(cfg, params, allow_padding=True)
  plan = []
  for name, rule, layer in layout.entries(cfg):
    leaf = layout.get_leaf(params, rule.path)
    dt = np.dtype(dtype if dtype is not None else leaf.dtype)
    logical = _logical_shape(cfg, leaf, rule, layer)
    plan.append((name, tuple(rule.hf_shape(cfg)), dt,
                 lambda leaf=leaf, rule=rule, layer=layer, logical=logical:
                 _host_tensor(leaf, rule, layer, dtype, logical)))
  return plan


def iter_hf_tensors(cfg: ModelConfig, params: Params, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, numpy tensor in HF layout) one at a time; `dtype` None keeps each leaf's."""
  for name, _, _, produce in _plan(cfg, params, dtype):
    yield name, produce()


def to_hf_state_dict(cfg: ModelConfig, params: Params, dtype=None) -> dict[str, np.ndarray]:
  """The HF state dict of `params`: HF names, HF layouts ([out, in]), the params' dtype kept.

  Holds a full host copy of the model; `save_hf` streams instead.
  """
  return dict(iter_hf_tensors(cfg, params, dtype))


# ---- HF -> JAX --------------------------------------------------------------------------------


class _DictSource:
  """Tensors from an in-memory state dict (numpy arrays or anything np.asarray converts).

  The interface of `safetensors_io.SafetensorsReader`, which `_check_source` and `_assemble` read.
  """

  def __init__(self, state_dict: Mapping[str, Any]):
    self._sd = state_dict

  def names(self):
    return list(self._sd)

  def shape(self, name):
    return tuple(self._sd[name].shape)

  def dtype(self, name):
    return np.dtype(self._sd[name].dtype)

  def where(self, name):
    return "state_dict"

  def read(self, name, index):
    return np.asarray(self._sd[name][index])


def _check_source(cfg: ModelConfig, src, location: str) -> np.dtype:
  """Validates names, shapes and dtypes of `src` against `cfg`; returns the checkpoint dtype."""
  expected = {name: tuple(rule.hf_shape(cfg)) for name, rule, _ in layout.entries(cfg)}
  present = set(src.names())
  missing = [name for name in expected if name not in present]
  if missing:
    raise ValueError(f"{location}: {len(missing)} tensor(s) that config.json implies are missing, "
                     f"e.g. {missing[:4]} (model_type={cfg.model_type}, num_hidden_layers="
                     f"{cfg.num_hidden_layers}, tie_word_embeddings={cfg.tie_word_embeddings}, "
                     f"attention_bias={cfg.attention_bias})")
  tolerated = {_LM_HEAD} if cfg.tie_word_embeddings else set()
  extra = sorted(n for n in present - set(expected) - tolerated if not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise ValueError(f"{location}: {len(extra)} unexpected tensor(s), e.g. "
                     f"{[(n, src.where(n)) for n in extra[:4]]}; the checkpoint does not match "
                     f"config.json (model_type={cfg.model_type}, num_hidden_layers="
                     f"{cfg.num_hidden_layers})")
  for name, shape in expected.items():
    if src.shape(name) != shape:
      raise ValueError(f"{src.where(name)}: tensor {name!r} has shape {src.shape(name)}, expected "
                       f"{shape} (HF layout [out, in]) from config.json")
  dtypes = {name: src.dtype(name) for name in expected}
  for name, dt in dtypes.items():
    if dt not in safetensors_io.FLOATS:
      raise ValueError(f"{src.where(name)}: tensor {name!r} has dtype {dt}; parameters must be "
                       "floating point (float32, bfloat16, float16)")
  common, _ = Counter(dtypes.values()).most_common(1)[0]
  odd = [(n, str(dt)) for n, dt in dtypes.items() if dt != common]
  if odd:
    raise ValueError(f"{src.where(odd[0][0])}: tensor(s) {odd[:4]} differ in dtype from the other "
                     f"tensors ({common}); a checkpoint must use one dtype")
  if cfg.tie_word_embeddings and _LM_HEAD in present:
    full = (slice(None), slice(None))
    if (src.shape(_LM_HEAD) != src.shape(_EMBED) or src.dtype(_LM_HEAD) != src.dtype(_EMBED)
        or not np.array_equal(src.read(_LM_HEAD, full), src.read(_EMBED, full))):
      raise ValueError(f"{src.where(_LM_HEAD)}: config.json has tie_word_embeddings=true but "
                       f"{_LM_HEAD!r} differs from {_EMBED!r}; set tie_word_embeddings to false "
                       "if the checkpoint has a separate output head")
  return common


def _index_key(index) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def _read_leaf(cfg: ModelConfig, src, rule: layout.Rule, index: tuple, dtype) -> np.ndarray:
  """The slice `index` (of the JAX leaf's shape) of `rule`'s leaf, as numpy in `dtype`."""
  if rule.per_layer:
    layers, index = range(cfg.num_hidden_layers)[index[0]], index[1:]
  hf_index = index[::-1] if rule.transpose else index

  def one(name):
    x = src.read(name, hf_index)
    x = x.T if rule.transpose else x
    return x.astype(dtype, copy=False) if dtype is not None else x

  if not rule.per_layer:
    return np.ascontiguousarray(one(rule.hf_name))
  first = one(rule.hf_name.format(i=layers[0]))  # shardings never hand out an empty slice
  out = np.empty((len(layers),) + first.shape, first.dtype)  # filled in place: one leaf + one tensor
  out[0] = first
  del first
  for j, i in enumerate(layers[1:], start=1):
    out[j] = one(rule.hf_name.format(i=i))
  return out


def _read_padded(cfg: ModelConfig, src, rule: layout.Rule, index: tuple, dtype,
                 shape: tuple[int, ...], storage: tuple[int, ...]) -> np.ndarray:
  """`_read_leaf` of `index` into the padded storage shape `storage` of a leaf of logical `shape`:
  the part of the slice beyond the logical extent is zeros."""
  if storage == shape:
    return _read_leaf(cfg, src, rule, index, dtype)
  bounds = [s.indices(n) for s, n in zip(index, storage)]  # (start, stop, 1) per dimension
  inside = tuple(slice(min(a, n), min(b, n)) for (a, b, _), n in zip(bounds, shape))
  out_shape = tuple(b - a for a, b, _ in bounds)
  if any(s.stop <= s.start for s in inside):
    return np.zeros(out_shape, np.dtype(dtype) if dtype is not None else np.float32)
  part = _read_leaf(cfg, src, rule, inside, dtype)
  out = np.zeros(out_shape, part.dtype)
  out[tuple(slice(0, s.stop - s.start) for s in inside)] = part
  return out


def _assemble(cfg: ModelConfig, src, dtype, shardings) -> Params:
  """Builds the params pytree leaf by leaf from a validated source. With NamedShardings whose axes
  do not divide a leaf, the leaf is built in its padded storage shape (`sharding.storage_shape`)."""
  params: Params = {}
  for rule in layout.rules_for(cfg):
    shape = rule.jax_shape(cfg)
    full = tuple(slice(None) for _ in shape)
    sharding = shardings
    if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
      sharding = layout.get_leaf(shardings, rule.path, what="shardings")
    if sharding is None:
      leaf = jax.device_put(_read_leaf(cfg, src, rule, full, dtype))
    else:
      cache: dict[tuple, np.ndarray] = {}  # replicated slices are read once, not once per device
      storage = sharding_lib.storage_shape(shape, sharding.spec, sharding.mesh) if isinstance(
          sharding, jax.sharding.NamedSharding) else shape

      def callback(index, rule=rule, cache=cache, shape=shape, storage=storage):
        key = _index_key(index)
        if key not in cache:
          cache[key] = _read_padded(cfg, src, rule, index, dtype, shape, storage)
        return cache[key]

      leaf = jax.make_array_from_callback(storage, sharding, callback)
      cache.clear()
    layout.set_leaf(params, rule.path, leaf)
  return params


def from_hf_state_dict(cfg: ModelConfig, state_dict: Mapping[str, Any], dtype=None,
                       shardings=None) -> Params:
  """The params pytree (jax arrays) of an HF state dict of numpy arrays (HF names and layouts).

  `dtype` None keeps the state dict's dtype; `shardings` as in `load_hf`.
  """
  src = _DictSource(state_dict)
  _check_source(cfg, src, "state_dict")
  return _assemble(cfg, src, dtype, shardings)


def load_hf(path: str, dtype=jnp.float32, shardings=None) -> tuple[ModelConfig, Params]:
  """Loads an HF model directory (config.json + safetensors, sharded or not).

  Args:
    path: the directory.
    dtype: the dtype of the returned leaves (cast on host, per slice); None keeps the checkpoint's.
      The returned config's `param_dtype` is set to it.
    shardings: None (leaves on the default device), one `jax.sharding.Sharding` for every leaf, or a
      pytree of the params' structure of shardings; each device then reads only its slice. A leaf
      whose NamedSharding's axes do not divide it comes back in its padded storage shape
      (`sharding.storage_shape`, zeros beyond the checkpoint's extent), as the trainer stores it.
  Returns:
    (cfg, params) with params in the WORKSPACE.md layout.
  """
  cfg = ModelConfig.from_hf_dir(path)
  with contextlib.ExitStack() as stack:
    src = safetensors_io.SafetensorsReader(path, stack)
    ckpt_dtype = _check_source(cfg, src, path)
    out_dtype = np.dtype(dtype) if dtype is not None else ckpt_dtype
    if out_dtype.name in ("float32", "bfloat16", "float16"):
      cfg = cfg.replace(param_dtype=out_dtype.name)
    params = _assemble(cfg, src, out_dtype, shardings)
  return cfg, params


# ---- writing ----------------------------------------------------------------------------------


def save_hf(cfg: ModelConfig, params: Params, out_dir: str, tokenizer_dir: Optional[str] = None,
            max_shard_bytes: int = 5 * 2**30, dtype=None) -> None:
  """Writes an HF model directory that transformers and vLLM load.

  Files: config.json, generation_config.json, model.safetensors (or model-0000k-of-0000N.safetensors
  shards with model.safetensors.index.json when larger than `max_shard_bytes`), and the tokenizer
  files of `tokenizer_dir` when given (and its generation_config.json, which keeps every eos id of
  the source model, when it has one). The directory is written under a temporary name next to
  `out_dir` and renamed into place (replacing an existing `out_dir`).

  Args:
    cfg: the architecture; config.json is `cfg.to_hf_dict()` with the dtype actually written.
    params: the pytree (jax arrays, fully addressable, or numpy), all leaves of one float dtype
      unless `dtype` is given.
    dtype: None writes the params' dtype; else every tensor is cast to it while writing (e.g. float32
      master weights saved as bfloat16).
  """
  plan = _plan(cfg, params, dtype)
  dtypes = sorted({str(dt) for _, _, dt, _ in plan})
  if len(dtypes) != 1:
    raise ValueError(f"params mix dtypes {dtypes}; pass save_hf(..., dtype=...) to write one dtype")
  written = plan[0][2]
  if written not in safetensors_io.FLOATS or written.name not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"params have dtype {written}; save_hf writes float32, bfloat16 or float16")
  with safetensors_io.staged_dir(out_dir) as tmp:
    write_config_files(cfg, tmp, written.name, tokenizer_dir)
    safetensors_io.write_model_files(tmp, plan, max_shard_bytes)
    if tokenizer_dir is not None:
      safetensors_io.copy_tokenizer(tokenizer_dir, tmp)


def write_config_files(cfg: ModelConfig, directory: str, dtype_name: str,
                       tokenizer_dir: Optional[str] = None) -> None:
  """config.json (`cfg` with param dtype `dtype_name`) and generation_config.json into `directory`.

  What an engine needs to build the model without its weights (vLLM `load_format="dummy"`, then
  weights over shared memory), and what `save_hf` writes beside the safetensors. With
  `tokenizer_dir`, its generation_config.json is kept (every eos id of the source model, e.g.
  Llama-3.2-Instruct's 128001/128008/128009, and its sampling defaults), with cfg's eos added.
  """
  hf_config = cfg.replace(param_dtype=dtype_name).to_hf_dict()
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
         if getattr(cfg, k) is not None}
  source_gen = os.path.join(tokenizer_dir, "generation_config.json") if tokenizer_dir else ""
  if source_gen and os.path.isfile(source_gen):
    with open(source_gen) as f:
      src = json.load(f)
    eos = src.get("eos_token_id")
    eos = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    if cfg.eos_token_id is not None and cfg.eos_token_id not in eos:
      eos.append(cfg.eos_token_id)
    gen = {**gen, **src, **({"eos_token_id": eos if len(eos) > 1 else eos[0]} if eos else {})}
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2, sort_keys=True)
