"""Architectures of the models users post-train, as published in their HF config.json files.

Parameter counts are checked against transformers in tests/models/test_layout.py.
"""
from __future__ import annotations

from jaxreplay.models.config import ModelConfig

_LLAMA3_SCALING = tuple(sorted({
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}.items()))


def qwen3_0_6b(**overrides) -> ModelConfig:
  return ModelConfig(
      model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
      num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
      rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
      max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645).replace(**overrides)


def qwen3_8b(**overrides) -> ModelConfig:
  return ModelConfig(
      model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
      rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=True,
      max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645).replace(**overrides)


def qwen2_5_7b(**overrides) -> ModelConfig:
  return ModelConfig(
      model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
      rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=False,
      attention_bias=True, max_position_embeddings=131072, bos_token_id=151643,
      eos_token_id=151643).replace(**overrides)


def llama3_2_3b(**overrides) -> ModelConfig:
  return ModelConfig(
      model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
      num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
      rms_norm_eps=1e-5, rope_theta=500_000.0, rope_scaling=_LLAMA3_SCALING,
      tie_word_embeddings=True, qk_norm=False, attention_bias=False,
      max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001).replace(**overrides)


def tiny(vocab_size: int = 64, **overrides) -> ModelConfig:
  """A 2-layer Qwen3 for CPU runs and tests. head_dim 32: vLLM's CPU attention rejects head_dim 16."""
  return ModelConfig(
      model_type="qwen3", vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
      rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True, qk_norm=True,
      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0).replace(**overrides)


def nano(vocab_size: int = 64, **overrides) -> ModelConfig:
  """`tiny` at half the width (hidden 64, 2 heads of 32, one KV head): ~0.1M parameters, ~3x cheaper
  per token on CPU; enough for the scratchpad-addition task (configs/scratchpad.py)."""
  return tiny(vocab_size, hidden_size=64, intermediate_size=192, num_attention_heads=2,
              num_key_value_heads=1).replace(**overrides)


PRESETS = {
    "qwen3_0_6b": qwen3_0_6b, "qwen3_8b": qwen3_8b, "qwen2_5_7b": qwen2_5_7b,
    "llama3_2_3b": llama3_2_3b, "tiny": tiny, "nano": nano,
}
