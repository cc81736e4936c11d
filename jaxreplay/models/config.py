"""`ModelConfig`: the architecture of a Qwen3 / Qwen2.5 / Llama-3 model, and HF config.json <-> it.

The config is a frozen, hashable dataclass so that it can be a static argument of `jax.jit`.
Sizes (`num_params`, `flops_per_token`) are read from the parameter layout table (`layout.RULES`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax.numpy as jnp

from jaxreplay.models import layout

# model_type -> the HF `architectures` entry transformers and vLLM dispatch on.
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The attention kernels of `transformer.attention` (config key model.attention): "auto" is cuDNN
# flash attention on GPU in 16-bit compute, else XLA's; "einsum" is the reference implementation.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "einsum")
AUTO_UNROLL_LAYERS = 4  # scan_unroll=0 unrolls the layer scan fully up to this many layers


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyper-parameters (names follow HF's config.json) plus JAX-side options.

  `head_dim` is independent of hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 != 128).
  `rope_scaling` is None or a sorted tuple of (key, value) pairs, e.g. llama3's factors.
  `dtype` is the compute dtype, `param_dtype` the storage dtype of parameters.
  `attention` picks the attention kernel (one of ATTENTION_IMPLEMENTATIONS; not part of config.json).
  """
  model_type: str = "qwen3"
  vocab_size: int = 151936
  hidden_size: int = 1024
  intermediate_size: int = 3072
  num_hidden_layers: int = 28
  num_attention_heads: int = 16
  num_key_value_heads: int = 8
  head_dim: int = 128
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  qk_norm: bool = True
  max_position_embeddings: int = 40960
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"
  scan_unroll: int = 0  # layers per iteration of the layer scan; 0 = auto (`layer_unroll`)

  def __post_init__(self):
    if self.model_type not in ARCHITECTURES:
      raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {sorted(ARCHITECTURES)}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_key_value_heads}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {sorted(_DTYPES)}")
    if self.scan_unroll < 0:
      raise ValueError(f"scan_unroll={self.scan_unroll} (config model.scan_unroll): expected >= 0 "
                       "(0 = auto, 1 = a rolled loop over the layers, k = k layers per iteration)")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention={self.attention!r} (config model.attention): expected one of "
                       f"{ATTENTION_IMPLEMENTATIONS}")
    if self.attention == "cudnn" and self.dtype == "float32":
      raise ValueError("attention='cudnn' needs 16-bit compute (cuDNN flash attention has no float32 "
                       "kernel): set model.dtype='bfloat16', or model.attention='auto' / 'xla'")

  @property
  def layer_unroll(self) -> int:
    """Layers per iteration of the forward's `lax.scan`: `scan_unroll`, or with 0 (auto) all of
    them when there are at most AUTO_UNROLL_LAYERS and no remat (small models: the loop's
    per-iteration overhead and the fusion it blocks cost ~15-25% of a CPU train step), else 1
    (compile time stays flat; under remat the rolled loop is what bounds the recomputed layers'
    live memory: unrolled, XLA kept ~1.7x the temp bytes in tests/config/test_memory_plan.py)."""
    if self.scan_unroll:
      return min(self.scan_unroll, self.num_hidden_layers)
    if self.remat or self.num_hidden_layers > AUTO_UNROLL_LAYERS:
      return 1
    return self.num_hidden_layers

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def params_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def rope_scaling_dict(self) -> Optional[dict[str, Any]]:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @property
  def architecture(self) -> str:
    return ARCHITECTURES[self.model_type]

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # ---- HF config.json <-> ModelConfig -------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json", **overrides) -> "ModelConfig":
    """Reads an HF config dict (transformers 4.x or 5.x layout). `source` names the file in errors."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type not in ARCHITECTURES:
      raise ValueError(f"{source}: unsupported model_type {model_type!r} (architectures={archs}); "
                       f"jaxreplay supports {sorted(ARCHITECTURES)} ({sorted(ARCHITECTURES.values())})")
    if archs and archs[0] != ARCHITECTURES[model_type]:
      raise ValueError(f"{source}: architectures={archs} does not match model_type={model_type!r}; "
                       f"expected {ARCHITECTURES[model_type]!r}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
      raise ValueError(f"{source}: missing required fields {missing}")
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    # transformers 5 writes `rope_parameters`; older files have top-level rope_theta / rope_scaling.
    rope_params = dict(d.get("rope_parameters") or {})
    rope_theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {}
    if rope_params.get("rope_type", "default") != "default":
      scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
      scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
      rope_scaling = None
    elif scaling["rope_type"] == "llama3":
      rope_scaling = tuple(sorted((k, scaling[k]) for k in (
          "rope_type", "factor", "low_freq_factor", "high_freq_factor",
          "original_max_position_embeddings")))
    else:
      raise ValueError(f"{source}: unsupported rope scaling {scaling!r}; supported: default, llama3")
    if model_type == "qwen2":
      attention_bias = True  # Qwen2/2.5 always have q/k/v biases.
    else:
      attention_bias = bool(d.get("attention_bias", False))
    if d.get("mlp_bias"):
      raise ValueError(f"{source}: mlp_bias=True is not supported")
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
      eos = eos[0] if eos else None
    kwargs = dict(
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(heads),
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        # An absent key means untied: transformers' Qwen3/Qwen2/Llama configs all default to False.
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=d.get("pad_token_id"),
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_dict(self) -> dict[str, Any]:
    """An HF config dict that transformers (4.x and 5.x) and vLLM load."""
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    d: dict[str, Any] = {
        "architectures": [self.architecture],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        "pad_token_id": self.pad_token_id,
        "torch_dtype": self.param_dtype,
        "dtype": self.param_dtype,
    }
    if self.model_type in ("qwen3", "llama"):
      d["attention_bias"] = self.attention_bias
    if self.model_type == "llama":
      d["mlp_bias"] = False
      d["pretraining_tp"] = 1
    if self.model_type in ("qwen2", "qwen3"):
      d.update(use_sliding_window=False, sliding_window=None,
               max_window_layers=self.num_hidden_layers)
    if self.rope_scaling is not None:
      scaling = dict(self.rope_scaling)
      d["rope_scaling"] = scaling
      rope_parameters = {**scaling, "rope_theta": self.rope_theta}
    d["rope_parameters"] = rope_parameters
    return d

  @classmethod
  def from_hf_dir(cls, path: str, **overrides) -> "ModelConfig":
    """Reads `path/config.json`; raises FileNotFoundError naming the file when it is absent."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
      raise FileNotFoundError(f"{cfg_path} not found: expected a Hugging Face model directory "
                              "(config.json + *.safetensors)")
    with open(cfg_path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    return cls.from_hf_dict(d, source=cfg_path, **overrides)

  # ---- sizes -----------------------------------------------------------------------------

  def num_params(self) -> int:
    """Parameter count (what transformers' `num_parameters()` reports for the same config)."""
    return layout.num_params(self)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token of a `seq_len`-token sequence (see `layout.flops_per_token`)."""
    return layout.flops_per_token(self, seq_len)
