"""Exact conversion between the jaxreplay parameter pytree and Hugging Face checkpoints.

One table, `RULES`, maps every HF tensor name to a JAX path and the layout change between them; both
directions (`to_hf_state_dict` / `save_hf` and `from_hf_state_dict` / `load_hf`) read it.

Layouts. HF linear weights are [out, in]; jaxreplay kernels are [in, out] (the table transposes).
Per-layer HF tensors `model.layers.{i}.<name>` are stacked on axis 0 of `params["layers"][<leaf>]`.

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
import dataclasses
import glob
import json
import math
import os
import shutil
import struct
import tempfile
import uuid
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; safetensors' numpy reader needs it)
import numpy as np
from safetensors import safe_open

from jaxreplay.models.config import ModelConfig

Params = dict[str, Any]

# ---- the table ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor (or one per layer when `hf_name` has `{i}`) <-> one JAX leaf.

  `hf_shape(cfg)` is the HF shape of one tensor. The JAX leaf has that shape reversed when
  `transpose` (2-D kernels only), with num_hidden_layers prepended when per-layer.
  """
  hf_name: str
  path: tuple[str, ...]
  hf_shape: Callable[[ModelConfig], tuple[int, ...]]
  transpose: bool = False
  when: Callable[[ModelConfig], bool] = lambda cfg: True

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf_name

  def jax_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
    shape = tuple(self.hf_shape(cfg))
    if self.transpose:
      shape = shape[::-1]
    return (cfg.num_hidden_layers,) + shape if self.per_layer else shape


def _d(c):
  return c.hidden_size


def _q(c):
  return c.num_attention_heads * c.head_dim


def _kv(c):
  return c.num_key_value_heads * c.head_dim


_L = "model.layers.{i}."
RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("embed_tokens",), lambda c: (c.vocab_size, _d(c))),
    Rule(_L + "input_layernorm.weight", ("layers", "input_layernorm"), lambda c: (_d(c),)),
    Rule(_L + "self_attn.q_proj.weight", ("layers", "q_proj"), lambda c: (_q(c), _d(c)), True),
    Rule(_L + "self_attn.k_proj.weight", ("layers", "k_proj"), lambda c: (_kv(c), _d(c)), True),
    Rule(_L + "self_attn.v_proj.weight", ("layers", "v_proj"), lambda c: (_kv(c), _d(c)), True),
    Rule(_L + "self_attn.o_proj.weight", ("layers", "o_proj"), lambda c: (_d(c), _q(c)), True),
    Rule(_L + "self_attn.q_proj.bias", ("layers", "q_bias"), lambda c: (_q(c),),
         when=lambda c: c.attention_bias),
    Rule(_L + "self_attn.k_proj.bias", ("layers", "k_bias"), lambda c: (_kv(c),),
         when=lambda c: c.attention_bias),
    Rule(_L + "self_attn.v_proj.bias", ("layers", "v_bias"), lambda c: (_kv(c),),
         when=lambda c: c.attention_bias),
    Rule(_L + "self_attn.q_norm.weight", ("layers", "q_norm"), lambda c: (c.head_dim,),
         when=lambda c: c.qk_norm),
    Rule(_L + "self_attn.k_norm.weight", ("layers", "k_norm"), lambda c: (c.head_dim,),
         when=lambda c: c.qk_norm),
    Rule(_L + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm"),
         lambda c: (_d(c),)),
    Rule(_L + "mlp.gate_proj.weight", ("layers", "gate_proj"),
         lambda c: (c.intermediate_size, _d(c)), True),
    Rule(_L + "mlp.up_proj.weight", ("layers", "up_proj"),
         lambda c: (c.intermediate_size, _d(c)), True),
    Rule(_L + "mlp.down_proj.weight", ("layers", "down_proj"),
         lambda c: (_d(c), c.intermediate_size), True),
    Rule("model.norm.weight", ("norm",), lambda c: (_d(c),)),
    Rule("lm_head.weight", ("lm_head",), lambda c: (c.vocab_size, _d(c)), True,
         when=lambda c: not c.tie_word_embeddings),
)
_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# safetensors dtype codes <-> numpy.
_ST_TO_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
             "BOOL": np.bool_}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_TO_NP.items()}
_FLOATS = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


def rules_for(cfg: ModelConfig) -> list[Rule]:
  """The rules that apply to `cfg` (biases, q/k norms and lm_head depend on the architecture)."""
  if cfg.attention_bias and cfg.model_type != "qwen2":
    # transformers' Llama / Qwen3 `attention_bias` also adds an o_proj bias, which the pytree lacks.
    raise ValueError(f"attention_bias=True with model_type={cfg.model_type!r} (q/k/v/o biases in "
                     "transformers) is not supported; only qwen2 has q/k/v biases")
  return [r for r in RULES if r.when(cfg)]


def _entries(cfg: ModelConfig) -> list[tuple[str, Rule, Optional[int]]]:
  """(HF name, rule, layer or None) for every HF tensor, in HF's state-dict order."""
  rules = rules_for(cfg)
  head = [(r.hf_name, r, None) for r in rules if not r.per_layer and r.path == ("embed_tokens",)]
  tail = [(r.hf_name, r, None) for r in rules if not r.per_layer and r.path != ("embed_tokens",)]
  layers = [(r.hf_name.format(i=i), r, i) for i in range(cfg.num_hidden_layers)
            for r in rules if r.per_layer]
  return head + layers + tail


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name of a checkpoint of `cfg`."""
  return [name for name, _, _ in _entries(cfg)]


def param_shapes(cfg: ModelConfig) -> Params:
  """The parameter pytree of `cfg` with shape tuples as leaves (the WORKSPACE.md layout)."""
  tree: Params = {}
  for r in rules_for(cfg):
    _set(tree, r.path, r.jax_shape(cfg))
  return tree


def _get(tree, path, what="params"):
  node = tree
  for i, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(f"{what} has no leaf {'/'.join(path[:i + 1])!r} (expected the pytree layout "
                       "of WORKSPACE.md for this ModelConfig)")
    node = node[key]
  return node


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _leaf_paths(tree, prefix=()) -> list[tuple[str, ...]]:
  if not isinstance(tree, Mapping):
    return [prefix]
  return [p for k in tree for p in _leaf_paths(tree[k], prefix + (k,))]


def check_params(cfg: ModelConfig, params: Params) -> None:
  """Raises ValueError when `params` lacks a leaf of `cfg`, has an extra one, or a wrong shape."""
  rules = rules_for(cfg)
  expected = {r.path for r in rules}
  extra = sorted("/".join(p) for p in _leaf_paths(params) if p not in expected)
  if extra:
    raise ValueError(f"params has leaves {extra} that ModelConfig({cfg.model_type}, "
                     f"tie_word_embeddings={cfg.tie_word_embeddings}, attention_bias="
                     f"{cfg.attention_bias}, qk_norm={cfg.qk_norm}) does not have")
  for r in rules:
    leaf = _get(params, r.path)
    if tuple(leaf.shape) != r.jax_shape(cfg):
      raise ValueError(f"params leaf {'/'.join(r.path)!r} has shape {tuple(leaf.shape)}, expected "
                       f"{r.jax_shape(cfg)} for this ModelConfig")


# ---- JAX -> HF --------------------------------------------------------------------------------


def _host_tensor(leaf, rule: Rule, layer: Optional[int], dtype) -> np.ndarray:
  """One HF tensor (HF layout, C-contiguous numpy) out of a JAX leaf; a device slice when jax."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    raise ValueError(f"leaf {'/'.join(rule.path)!r} is not fully addressable from this process; "
                     "gather it (e.g. with jax.experimental.multihost_utils) before saving")
  x = np.asarray(leaf if layer is None else leaf[layer])
  if rule.transpose:
    x = x.T
  if dtype is not None:
    x = x.astype(dtype, copy=False)
  return np.ascontiguousarray(x)


def _plan(cfg: ModelConfig, params: Params, dtype=None):
  """(HF name, HF shape, numpy dtype, producer) per tensor; checks params first."""
  check_params(cfg, params)
  plan = []
  for name, rule, layer in _entries(cfg):
    leaf = _get(params, rule.path)
    dt = np.dtype(dtype if dtype is not None else leaf.dtype)
    plan.append((name, tuple(rule.hf_shape(cfg)), dt,
                 lambda leaf=leaf, rule=rule, layer=layer: _host_tensor(leaf, rule, layer, dtype)))
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
  """Tensors from an in-memory state dict (numpy arrays or anything np.asarray converts)."""

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


class _SafetensorsSource:
  """Tensors from the *.safetensors files of a directory, read slice by slice with safe_open."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    self.path = path
    files = _shard_files(path)
    self._file_of: dict[str, str] = {}
    self._handles = {}
    for file in files:
      try:
        handle = stack.enter_context(safe_open(file, framework="numpy"))
      except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers.
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
      self._handles[file] = handle
      for name in handle.keys():
        if name in self._file_of:
          raise ValueError(f"tensor {name!r} is in both {self._file_of[name]} and {file}")
        self._file_of[name] = file
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
      weight_map = _read_index(index_path)
      for name, shard in weight_map.items():
        actual = self._file_of.get(name)
        if actual != os.path.join(path, shard):
          where = "no shard holds it" if actual is None else f"it is in {actual}"
          raise ValueError(f"{index_path}: weight_map puts {name!r} in {shard}, but {where}")

  def names(self):
    return list(self._file_of)

  def _slice(self, name):
    return self._handles[self._file_of[name]].get_slice(name)

  def shape(self, name):
    return tuple(self._slice(name).get_shape())

  def dtype(self, name):
    code = self._slice(name).get_dtype()
    return np.dtype(_ST_TO_NP[code]) if code in _ST_TO_NP else code

  def where(self, name):
    return self._file_of[name]

  def read(self, name, index):
    return self._slice(name)[index]


def _read_index(index_path: str) -> dict[str, str]:
  try:
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"{index_path}: not a valid safetensors index (expected JSON with a "
                     f"'weight_map' of tensor name -> shard file): {e!r}") from e
  return weight_map


def _shard_files(path: str) -> list[str]:
  """The safetensors files of a model dir: the index's shards, else every *.safetensors."""
  index_path = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    shards = sorted(set(_read_index(index_path).values()))
    for shard in shards:
      if not os.path.isfile(os.path.join(path, shard)):
        raise FileNotFoundError(f"{index_path} lists shard {shard!r}, which is not in {path} "
                                "(an interrupted copy or download?)")
    return [os.path.join(path, s) for s in shards]
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    other = sorted(os.path.basename(f) for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt")
                   for f in glob.glob(os.path.join(path, pattern)))
    hint = (f" It has {other[:3]}: PyTorch pickle checkpoints must be converted first, e.g. "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir) "
            "(writes safetensors).") if other else ""
    raise FileNotFoundError(f"{path}: no *.safetensors files.{hint}")
  return files


def _check_source(cfg: ModelConfig, src, location: str) -> np.dtype:
  """Validates names, shapes and dtypes of `src` against `cfg`; returns the checkpoint dtype."""
  entries = _entries(cfg)
  expected = {name: tuple(rule.hf_shape(cfg)) for name, rule, _ in entries}
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
    if dt not in _FLOATS:
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


def _read_leaf(cfg: ModelConfig, src, rule: Rule, index: tuple, dtype) -> np.ndarray:
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


def _assemble(cfg: ModelConfig, src, dtype, shardings) -> Params:
  """Builds the params pytree leaf by leaf from a validated source."""
  params: Params = {}
  for rule in rules_for(cfg):
    shape = rule.jax_shape(cfg)
    full = tuple(slice(None) for _ in shape)
    sharding = shardings
    if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
      sharding = _get(shardings, rule.path, what="shardings")
    if sharding is None:
      leaf = jax.device_put(_read_leaf(cfg, src, rule, full, dtype))
    else:
      cache: dict[tuple, np.ndarray] = {}  # replicated slices are read once, not once per device

      def callback(index, rule=rule, cache=cache):
        key = _index_key(index)
        if key not in cache:
          cache[key] = _read_leaf(cfg, src, rule, index, dtype)
        return cache[key]

      leaf = jax.make_array_from_callback(shape, sharding, callback)
      cache.clear()
    _set(params, rule.path, leaf)
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
      pytree of the params' structure of shardings; each device then reads only its slice.
  Returns:
    (cfg, params) with params in the WORKSPACE.md layout.
  """
  cfg = ModelConfig.from_hf_dir(path)
  with contextlib.ExitStack() as stack:
    src = _SafetensorsSource(path, stack)
    ckpt_dtype = _check_source(cfg, src, path)
    out_dtype = np.dtype(dtype) if dtype is not None else ckpt_dtype
    if out_dtype.name in ("float32", "bfloat16", "float16"):
      cfg = cfg.replace(param_dtype=out_dtype.name)
    params = _assemble(cfg, src, out_dtype, shardings)
  return cfg, params


# ---- writing ----------------------------------------------------------------------------------


def _write_safetensors(path: str, plan) -> None:
  """Writes one safetensors file, producing and writing one tensor at a time."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, shape, dt, _ in plan:
    nbytes = math.prod(shape) * dt.itemsize
    header[name] = {"dtype": _NP_TO_ST[dt], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes with spaces
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dt, produce in plan:
      x = produce()
      if x.shape != shape or x.dtype != dt:
        raise AssertionError(f"{name}: produced {x.shape} {x.dtype}, planned {shape} {dt}")
      f.write(x.reshape(-1).view(np.uint8).data)


def _split_shards(plan, max_shard_bytes: int) -> list[list]:
  """Greedy split in order, as transformers does; a tensor larger than the limit sits alone."""
  shards, size = [[]], 0
  for entry in plan:
    nbytes = math.prod(entry[1]) * entry[2].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  return shards


def _swap_into_place(tmp: str, out_dir: str) -> None:
  """Renames `tmp` to `out_dir`; an existing `out_dir` is moved aside first, then deleted.

  A reader sees the old directory, briefly none, or the new one; never a partial one.
  """
  if not os.path.lexists(out_dir):
    os.rename(tmp, out_dir)
    return
  if not os.path.isdir(out_dir) or os.path.islink(out_dir):
    raise ValueError(f"{out_dir} exists and is not a directory; refusing to replace it")
  parent, base = os.path.split(out_dir)
  old = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:8]}")
  os.rename(out_dir, old)
  os.rename(tmp, out_dir)
  shutil.rmtree(old, ignore_errors=True)


def _copy_tokenizer(tokenizer_dir: str, dest: str) -> list[str]:
  if not os.path.isdir(tokenizer_dir):
    raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
  found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
  if not found:
    raise ValueError(f"tokenizer_dir {tokenizer_dir} has none of the tokenizer files "
                     f"{list(TOKENIZER_FILES)}; save one with tokenizer.save_pretrained(dir)")
  for n in found:
    shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(dest, n))
  return found


def save_hf(cfg: ModelConfig, params: Params, out_dir: str, tokenizer_dir: Optional[str] = None,
            max_shard_bytes: int = 5 * 2**30, dtype=None) -> None:
  """Writes an HF model directory that transformers and vLLM load.

  Files: config.json, generation_config.json, model.safetensors (or model-0000k-of-0000N.safetensors
  shards with model.safetensors.index.json when larger than `max_shard_bytes`), and the tokenizer
  files of `tokenizer_dir` when given. The directory is written under a temporary name next to
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
  if written not in _FLOATS or written.name not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"params have dtype {written}; save_hf writes float32, bfloat16 or float16")
  out_dir = os.path.abspath(out_dir)
  parent, base = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
  try:
    hf_config = cfg.replace(param_dtype=written.name).to_hf_dict()
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(cfg, k) is not None}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump(gen, f, indent=2, sort_keys=True)
    shards = _split_shards(plan, max_shard_bytes)
    if len(shards) == 1:
      _write_safetensors(os.path.join(tmp, "model.safetensors"), shards[0])
    else:
      weight_map, total = {}, 0
      for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(os.path.join(tmp, fname), shard)
        for name, shape, dt, _ in shard:
          weight_map[name] = fname
          total += math.prod(shape) * dt.itemsize
      index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    if tokenizer_dir is not None:
      _copy_tokenizer(tokenizer_dir, tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    _swap_into_place(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
