"""Parameter counts of the real architectures, from shapes alone (no weights allocated).

jax.eval_shape of init_params for each preset must give exactly the count transformers reports for
the same config, built on torch's meta device.
"""
import math

import jax
import pytest

from conftest import require
from jaxreplay import models

PRESETS = ("qwen3_0_6b", "qwen3_8b", "qwen2_5_7b", "llama3_2_3b")


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_matches_transformers(name):
  torch = require("torch")
  transformers = require("transformers")
  cfg = models.presets.PRESETS[name]()
  shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
  ours = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  unique = {id(p): p.numel() for p in model.parameters()}  # tied weights count once
  theirs = sum(unique.values())
  assert ours == theirs, (name, ours, theirs)
  assert ours == cfg.num_params()
