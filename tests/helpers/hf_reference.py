"""transformers' own Qwen3 / Qwen2 / Llama (torch CPU, float32) as the reference of the functional
model: small configs covering every architecture option, random HF weights and the same weights as
our param pytree (tests/models/)."""
import functools

import jax.numpy as jnp
import numpy as np

from jaxreplay.models.config import ModelConfig
from tests.helpers.deps import require


_LLAMA3 = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}.items()))


def small(model_type, **kw):
  base = dict(model_type=model_type, vocab_size=101, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True,
              qk_norm=model_type == "qwen3", attention_bias=model_type == "qwen2",
              max_position_embeddings=256)
  base.update(kw)
  return ModelConfig(**base)


CONFIGS = {
    # head_dim 32 != 64 / 4, GQA 2, tied.
    "qwen3_tied_hd32": small("qwen3", head_dim=32),
    # GQA ratio 1, untied, head_dim 24.
    "qwen3_untied_mha": small("qwen3", num_key_value_heads=4, head_dim=24, tie_word_embeddings=False),
    "qwen2_untied_bias": small("qwen2", tie_word_embeddings=False),
    # GQA ratio 4, tied, head_dim 32.
    "qwen2_tied_gqa4": small("qwen2", num_key_value_heads=1, head_dim=32),
    # llama3 scaling with original_max_position_embeddings 32 < T: all three frequency bands occur.
    "llama3_scaled": small("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                           head_dim=24,
                           rope_scaling=_LLAMA3, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "llama_tied_mha": small("llama", num_key_value_heads=4, rope_theta=500_000.0),
}


@functools.lru_cache(maxsize=None)
def hf_model(cfg: ModelConfig, seed: int = 0):
  """A transformers model for `cfg` with all weights random (norms around 1, nonzero biases)."""
  torch = require("torch")
  transformers = require("transformers")
  d = cfg.to_hf_dict()
  hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
  assert type(model).__name__ == cfg.architecture
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.2 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[1]))
  return model.eval().float()


def params_from_torch(cfg: ModelConfig, model) -> dict:
  """HF state dict -> the jaxreplay pytree (layers stacked, kernels transposed to [in, out])."""
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  n = cfg.num_hidden_layers

  def stack(suffix, transpose=False):
    arrs = [sd[f"model.layers.{i}.{suffix}"] for i in range(n)]
    return jnp.asarray(np.stack([a.T if transpose else a for a in arrs]))

  layers = {
      "input_layernorm": stack("input_layernorm.weight"),
      "post_attention_layernorm": stack("post_attention_layernorm.weight"),
  }
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    layers[name] = stack(f"self_attn.{name}.weight", transpose=True)
  for name in ("gate_proj", "up_proj", "down_proj"):
    layers[name] = stack(f"mlp.{name}.weight", transpose=True)
  if cfg.attention_bias:
    for x in "qkv":
      layers[f"{x}_bias"] = stack(f"self_attn.{x}_proj.bias")
  if cfg.qk_norm:
    layers["q_norm"] = stack("self_attn.q_norm.weight")
    layers["k_norm"] = stack("self_attn.k_norm.weight")
  params = {"embed_tokens": jnp.asarray(sd["model.embed_tokens.weight"]), "layers": layers,
            "norm": jnp.asarray(sd["model.norm.weight"])}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = jnp.asarray(sd["lm_head.weight"].T)
  return params


def setup(name):
  """(cfg, the transformers model, its weights as our param pytree) of CONFIGS[name]."""
  cfg = CONFIGS[name]
  model = hf_model(cfg)
  return cfg, model, params_from_torch(cfg, model)


def random_tokens(cfg, shape, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)
