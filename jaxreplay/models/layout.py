"""The parameter layout: one table, `RULES`, from which every view of the params pytree is derived.

Each `Rule` ties one Hugging Face tensor (one per layer when its name has `{i}`) to one JAX leaf:
its path in the params pytree, its HF shape, whether the two layouts differ by a transpose, which
architectures have it and how `transformer.init_params` fills it. Derived from the table:
`param_shapes` (the pytree `init_params` fills), `check_params`, `entries` / `hf_names` (HF
state-dict order, for `hf_io`'s conversion both ways), `num_params` and `flops_per_token` (behind
the `ModelConfig` methods of the same names).

Layouts. HF linear weights are [out, in]; jaxreplay kernels are [in, out] (`transpose`). Per-layer
HF tensors `model.layers.{i}.<name>` are stacked on axis 0 of `params["layers"][<leaf>]`.

This module imports nothing of jaxreplay at run time (`ModelConfig` for type checking only), so
that `config.py` can import it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:
  from jaxreplay.models.config import ModelConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor (or one per layer when `hf_name` has `{i}`) <-> one JAX leaf.

  Attributes:
    hf_name: the HF state-dict name; `{i}` stands for the layer index.
    path: the leaf's keys in the params pytree.
    hf_shape: cfg -> the HF shape of one tensor. The JAX leaf has that shape reversed when
      `transpose` (2-D kernels only), with num_hidden_layers prepended when per-layer.
    transpose: HF [out, in] <-> JAX [in, out]; True exactly for the matmul kernels.
    init: how `transformer.init_params` fills the leaf: "normal" (N(0, std)), "ones" or "zeros".
    when: cfg -> whether the architecture has this tensor.
  """
  hf_name: str
  path: tuple[str, ...]
  hf_shape: Callable[[ModelConfig], tuple[int, ...]]
  transpose: bool = False
  init: str = "normal"
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


def _bias(c):
  return c.attention_bias


def _qk_norm(c):
  return c.qk_norm


_L = "model.layers.{i}."
RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("embed_tokens",), lambda c: (c.vocab_size, _d(c))),
    Rule(_L + "input_layernorm.weight", ("layers", "input_layernorm"), lambda c: (_d(c),),
         init="ones"),
    Rule(_L + "self_attn.q_proj.weight", ("layers", "q_proj"), lambda c: (_q(c), _d(c)), True),
    Rule(_L + "self_attn.k_proj.weight", ("layers", "k_proj"), lambda c: (_kv(c), _d(c)), True),
    Rule(_L + "self_attn.v_proj.weight", ("layers", "v_proj"), lambda c: (_kv(c), _d(c)), True),
    Rule(_L + "self_attn.o_proj.weight", ("layers", "o_proj"), lambda c: (_d(c), _q(c)), True),
    Rule(_L + "self_attn.q_proj.bias", ("layers", "q_bias"), lambda c: (_q(c),),
         init="zeros", when=_bias),
    Rule(_L + "self_attn.k_proj.bias", ("layers", "k_bias"), lambda c: (_kv(c),),
         init="zeros", when=_bias),
    Rule(_L + "self_attn.v_proj.bias", ("layers", "v_bias"), lambda c: (_kv(c),),
         init="zeros", when=_bias),
    Rule(_L + "self_attn.q_norm.weight", ("layers", "q_norm"), lambda c: (c.head_dim,),
         init="ones", when=_qk_norm),
    Rule(_L + "self_attn.k_norm.weight", ("layers", "k_norm"), lambda c: (c.head_dim,),
         init="ones", when=_qk_norm),
    Rule(_L + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm"),
         lambda c: (_d(c),), init="ones"),
    Rule(_L + "mlp.gate_proj.weight", ("layers", "gate_proj"),
         lambda c: (c.intermediate_size, _d(c)), True),
    Rule(_L + "mlp.up_proj.weight", ("layers", "up_proj"),
         lambda c: (c.intermediate_size, _d(c)), True),
    Rule(_L + "mlp.down_proj.weight", ("layers", "down_proj"),
         lambda c: (_d(c), c.intermediate_size), True),
    Rule("model.norm.weight", ("norm",), lambda c: (_d(c),), init="ones"),
    Rule("lm_head.weight", ("lm_head",), lambda c: (c.vocab_size, _d(c)), True,
         when=lambda c: not c.tie_word_embeddings),
)


def check_supported(cfg: ModelConfig) -> None:
  """Raises ValueError for configs the parameter pytree cannot represent."""
  if cfg.attention_bias and cfg.model_type != "qwen2":
    raise ValueError(
        f"attention_bias=True with model_type={cfg.model_type!r} also implies an o_proj bias in "
        "transformers, which the jaxreplay parameter pytree does not hold; only qwen2 (q/k/v "
        "biases, no o_proj bias) is supported with attention_bias=True")


def _applicable(cfg: ModelConfig) -> list[Rule]:
  return [r for r in RULES if r.when(cfg)]


def rules_for(cfg: ModelConfig) -> list[Rule]:
  """The rules that apply to `cfg` (biases, q/k norms and lm_head depend on the architecture).

  Raises ValueError (`check_supported`) when the pytree cannot represent `cfg`.
  """
  check_supported(cfg)
  return _applicable(cfg)


def entries(cfg: ModelConfig) -> list[tuple[str, Rule, Optional[int]]]:
  """(HF name, rule, layer or None) for every HF tensor, in HF's state-dict order."""
  rules = rules_for(cfg)
  head = [(r.hf_name, r, None) for r in rules if not r.per_layer and r.path == ("embed_tokens",)]
  tail = [(r.hf_name, r, None) for r in rules if not r.per_layer and r.path != ("embed_tokens",)]
  layers = [(r.hf_name.format(i=i), r, i) for i in range(cfg.num_hidden_layers)
            for r in rules if r.per_layer]
  return head + layers + tail


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name of a checkpoint of `cfg`, in HF's state-dict order."""
  return [name for name, _, _ in entries(cfg)]


# ---- pytrees ------------------------------------------------------------------------------------


def get_leaf(tree: Mapping, path: tuple[str, ...], what: str = "params") -> Any:
  """`tree[path[0]][path[1]]...`; ValueError naming the missing key (`what` names the tree)."""
  node = tree
  for i, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(f"{what} has no leaf {'/'.join(path[:i + 1])!r} (expected the pytree layout "
                       "of WORKSPACE.md for this ModelConfig)")
    node = node[key]
  return node


def set_leaf(tree: dict, path: tuple[str, ...], value: Any) -> None:
  """Sets `tree[path[0]][path[1]]... = value`, creating the inner dicts."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _leaf_paths(tree, prefix=()) -> list[tuple[str, ...]]:
  if not isinstance(tree, Mapping):
    return [prefix]
  return [p for k in tree for p in _leaf_paths(tree[k], prefix + (k,))]


def param_shapes(cfg: ModelConfig) -> Params:
  """The parameter pytree of `cfg` with shape tuples as leaves (the WORKSPACE.md layout)."""
  tree: Params = {}
  for r in rules_for(cfg):
    set_leaf(tree, r.path, r.jax_shape(cfg))
  return tree


def _slice_to(leaf, shape: tuple[int, ...]):
  """`leaf[:shape[0], :shape[1], ...]` (the leaf itself when its shape already is `shape`)."""
  if tuple(leaf.shape) == tuple(shape):
    return leaf
  return leaf[tuple(slice(0, n) for n in shape)]


def unpad(cfg: ModelConfig, params: Params, layers: bool = True) -> Params:
  """`params` with every leaf sliced to its logical shape (`Rule.jax_shape`).

  A trainer on a mesh whose axes do not divide a dimension stores that leaf padded at the end
  (`jaxreplay.infra.sharding.storage_shape`); the model functions call this first, so padded and unpadded
  params give the same results. layers=False leaves `params["layers"]` as it is (the forward's
  layer scan slices each layer with `unpad_layer`, so the stacked weights are never copied).
  Returns `params` itself when nothing is padded.
  """
  out, changed = {}, False
  for r in _applicable(cfg):
    leaf = get_leaf(params, r.path)
    if r.per_layer and not layers:
      set_leaf(out, r.path, leaf)
      continue
    sliced = _slice_to(leaf, r.jax_shape(cfg))
    changed |= sliced is not leaf
    set_leaf(out, r.path, sliced)
  return out if changed else params


def unpad_layer(cfg: ModelConfig, layer_params: Params) -> Params:
  """One layer's params (the leaves of `params["layers"]` without the layer axis) sliced to their
  logical shapes; `layer_params` itself when nothing is padded."""
  out, changed = dict(layer_params), False
  for r in _applicable(cfg):
    if r.per_layer and r.path[-1] in layer_params:
      leaf = layer_params[r.path[-1]]
      sliced = _slice_to(leaf, r.jax_shape(cfg)[1:])
      changed |= sliced is not leaf
      out[r.path[-1]] = sliced
  return out if changed else layer_params


def check_params(cfg: ModelConfig, params: Params, allow_padding: bool = False) -> None:
  """Raises ValueError when `params` lacks a leaf of `cfg`, has an extra one, or a wrong shape
  (with allow_padding, a leaf may be larger than its logical shape in any dimension: see `unpad`)."""
  rules = rules_for(cfg)
  expected = {r.path for r in rules}
  extra = sorted("/".join(p) for p in _leaf_paths(params) if p not in expected)
  if extra:
    raise ValueError(f"params has leaves {extra} that ModelConfig({cfg.model_type}, "
                     f"tie_word_embeddings={cfg.tie_word_embeddings}, attention_bias="
                     f"{cfg.attention_bias}, qk_norm={cfg.qk_norm}) does not have")
  for r in rules:
    leaf = get_leaf(params, r.path)
    shape, want = tuple(leaf.shape), r.jax_shape(cfg)
    if allow_padding and len(shape) == len(want) and all(a >= b for a, b in zip(shape, want)):
      continue
    if shape != want:
      raise ValueError(f"params leaf {'/'.join(r.path)!r} has shape {tuple(leaf.shape)}, expected "
                       f"{r.jax_shape(cfg)} for this ModelConfig")


# ---- sizes --------------------------------------------------------------------------------------
# These count the pytree's leaves without `check_supported`, so that they never raise (an
# unsupported llama with attention_bias=True counts its q/k/v biases, not the o_proj bias).


def num_params(cfg: ModelConfig) -> int:
  """Parameter count (what transformers' `num_parameters()` reports for the same config)."""
  return sum(math.prod(r.jax_shape(cfg)) for r in _applicable(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token of a `seq_len`-token sequence.

  2 * (per-layer matmul kernel params + the LM head's hidden * vocab, tied or not) + attention
  (2 * 2 * seq_len * num_attention_heads * head_dim per layer). Embedding lookups, norms and biases
  are not counted.
  """
  kernels = sum(math.prod(r.hf_shape(cfg)) for r in _applicable(cfg)
                if r.per_layer and r.transpose)
  matmul = cfg.num_hidden_layers * kernels + cfg.hidden_size * cfg.vocab_size
  attn = cfg.num_hidden_layers * 2 * _q(cfg) * seq_len  # QK^T and AV, causal average ~T/2 each x2
  return 2.0 * matmul + 2.0 * attn
