"""Functional Qwen3 / Qwen2.5 / Llama-3 models over parameter pytrees (see WORKSPACE.md)."""
from jaxreplay.models import presets
from jaxreplay.models.config import ModelConfig
from jaxreplay.models.decode import KVCache, decode_step, init_cache, prefill
from jaxreplay.models.hf_io import from_hf_state_dict, load_hf, save_hf, to_hf_state_dict
from jaxreplay.models.logprobs import logprobs_from_logits, token_logprobs
from jaxreplay.models.transformer import apply, hidden_states, init_params

__all__ = [
    "ModelConfig", "presets", "init_params", "apply", "hidden_states", "token_logprobs",
    "logprobs_from_logits", "KVCache", "init_cache", "prefill", "decode_step",
    "load_hf", "save_hf", "to_hf_state_dict", "from_hf_state_dict",
]
