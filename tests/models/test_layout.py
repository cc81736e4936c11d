"""Parameter counts of the presets: our pytree (shapes only) == transformers (meta device) ==
`ModelConfig.num_params()` (read from the layout table). No weights are allocated."""
import jax
import numpy as np
import pytest

from jaxreplay.models import layout, presets, transformer
from tests.helpers.deps import require

torch = require("torch")
transformers = require("transformers")

# Published sizes (HF model cards / config.json): a guard against a preset drifting on both sides.
PUBLISHED = {"qwen3_0_6b": 596_049_920, "qwen3_8b": 8_190_735_360, "qwen2_5_7b": 7_615_616_512,
             "llama3_2_3b": 3_212_749_824}


def hf_count(cfg) -> int:
  d = cfg.to_hf_dict()
  hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  assert type(model).__name__ == cfg.architecture
  unique = {}  # tied embeddings: lm_head.weight is embed_tokens.weight, counted once
  for _, p in model.named_parameters(remove_duplicate=False):
    assert p.is_meta
    unique[id(p)] = p.numel()
  return sum(unique.values())


@pytest.mark.parametrize("name", sorted(PUBLISHED) + ["tiny", "nano"])
def test_param_count_matches_transformers(name):
  cfg = presets.PRESETS[name]()
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  leaves = jax.tree.leaves(shapes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  ours = sum(int(np.prod(x.shape)) for x in leaves)
  assert ours == hf_count(cfg) == cfg.num_params()
  if name in PUBLISHED:
    assert ours == PUBLISHED[name]
  assert ("lm_head" in shapes) == (not cfg.tie_word_embeddings)


# The layout's count (behind ModelConfig.num_params) is the size of what init_params builds.
VARIANTS = {"preset": {}, "untied": {"tie_word_embeddings": False},
            "tied": {"tie_word_embeddings": True},
            "qwen2_bias": {"model_type": "qwen2", "attention_bias": True, "qk_norm": False}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_layout_counts_equal_init_params(name, variant):
  cfg = presets.PRESETS[name](**VARIANTS[variant])
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  assert jax.tree.map(lambda x: x.shape, shapes) == layout.param_shapes(cfg)
  ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert layout.num_params(cfg) == cfg.num_params() == ours
