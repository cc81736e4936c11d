"""LoRA adapters in the functional model (`models.lora`): exact against the base model, the merged
weights and the PEFT reference (transformers + peft), through the training forward and the KV-cache
decoder, and PEFT's file format both ways."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import decode
from jaxreplay.models import hf_io
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.models import lora
from tests.helpers.deps import require
from tests.helpers.tolerances import close, tree_scale

CFG = presets.tiny(vocab_size=64)
SPEC = lora.LoraSpec(rank=8, alpha=16.0)
apply = jax.jit(transformer.apply, static_argnums=0)
token_logprobs = jax.jit(logprobs_lib.token_logprobs, static_argnums=0)


def random_adapters(cfg, spec, seed=1, scale=0.05):
  """Adapters with b != 0 (a trained one): A as initialised, B ~ N(0, scale)."""
  adapters = lora.init_adapters(cfg, spec, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 2 * len(adapters)))
  return {t: {"a": ab["a"] + scale * jax.random.normal(next(keys), ab["a"].shape),
              "b": scale * jax.random.normal(next(keys), ab["b"].shape)}
          for t, ab in adapters.items()}


@pytest.fixture(scope="module")
def params():
  return jax.jit(transformer.init_params, static_argnums=0)(CFG, jax.random.key(0))


def tokens(seed=2, b=3, t=12):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def test_shapes_init_and_scale():
  shapes = lora.adapter_shapes(CFG, SPEC)
  d, f, q, kv = CFG.hidden_size, CFG.intermediate_size, 4 * 32, 2 * 32
  assert shapes["q_proj"] == {"a": (2, d, 8), "b": (2, 8, q)}
  assert shapes["k_proj"]["b"] == (2, 8, kv) and shapes["o_proj"]["a"] == (2, q, 8)
  assert shapes["down_proj"] == {"a": (2, f, 8), "b": (2, 8, d)}
  adapters = lora.init_adapters(CFG, SPEC, jax.random.key(0))
  assert set(adapters) == set(lora.TARGETS)
  for t, ab in adapters.items():
    assert not np.any(np.asarray(ab["b"]))  # PEFT's init: B = 0
    bound = 1.0 / np.sqrt(shapes[t]["a"][1])
    assert np.abs(np.asarray(ab["a"])).max() <= bound and np.asarray(ab["a"]).std() > bound / 3
  assert lora.num_params(CFG, SPEC) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
  assert SPEC.scale == 2.0 and lora.LoraSpec(16, 32.0, rslora=True).scale == 8.0
  assert lora.LoraSpec(8, 16.0, dtype="bfloat16").dtype == "bfloat16"
  bf16 = lora.init_adapters(CFG, lora.LoraSpec(8, 16.0, dtype="bfloat16"), jax.random.key(0))
  assert bf16["q_proj"]["a"].dtype == jnp.bfloat16


def test_zero_b_equals_the_base_model(params):
  x = tokens()
  adapters = lora.init_adapters(CFG, SPEC, jax.random.key(1))
  base = np.asarray(apply(CFG, params, x))
  adapted = np.asarray(apply(CFG, lora.attach(params, adapters, SPEC), x))
  np.testing.assert_allclose(adapted, base, **close(np.float32, CFG.intermediate_size,
                                                    tree_scale(base)))


def test_forward_equals_merged_weights(params):
  x = tokens()
  adapters = random_adapters(CFG, SPEC)
  adapted = np.asarray(apply(CFG, lora.attach(params, adapters, SPEC), x))
  merged = lora.merge(CFG, params, adapters, SPEC)
  reference = np.asarray(apply(CFG, merged, x))
  tol = close(np.float32, CFG.intermediate_size, tree_scale(reference))
  np.testing.assert_allclose(adapted, reference, **tol)
  assert np.abs(reference - np.asarray(apply(CFG, params, x))).max() > 1000 * tol["atol"]
  # numpy merge (exports) == jax merge
  host = lora.merge(CFG, jax.device_get(params), jax.device_get(adapters), SPEC)
  chex.assert_trees_all_close(host, jax.device_get(merged), **close(np.float32, SPEC.rank, 1.0))
  # rsLoRA: scale alpha / sqrt(r) in the forward and in the merge alike
  rs = lora.LoraSpec(8, 16.0, rslora=True)
  np.testing.assert_allclose(np.asarray(apply(CFG, lora.attach(params, adapters, rs), x)),
                             np.asarray(apply(CFG, lora.merge(CFG, params, adapters, rs), x)),
                             **close(np.float32, CFG.intermediate_size, tree_scale(reference)))


def test_subset_of_targets_and_padded_base(params):
  """Adapters on q/v only; and a base stored padded (as on a mesh an axis of which does not
  divide it) gives the same logits: the kernel's padding is sliced, the adapter's never padded."""
  spec = lora.LoraSpec(4, 8.0, targets=("q_proj", "v_proj"))
  adapters = random_adapters(CFG, spec, seed=3)
  x = tokens(4)
  reference = np.asarray(apply(CFG, lora.merge(CFG, params, adapters, spec), x))
  padded = jax.tree.map(lambda w: jnp.pad(w, [(0, 0)] + [(0, 3)] * (w.ndim - 1)), params)
  for p in (params, padded):
    np.testing.assert_allclose(np.asarray(apply(CFG, lora.attach(p, adapters, spec), x)), reference,
                               **close(np.float32, CFG.intermediate_size, tree_scale(reference)))


def test_decoder_with_adapters_matches_the_forward(params):
  """The JAX sampler's path (prefill + decode_step over attached params) == the training forward."""
  adapters = random_adapters(CFG, SPEC, seed=5)
  attached = lora.attach(params, adapters, SPEC)
  seq = np.asarray(tokens(6, b=2, t=10))
  full = np.asarray(apply(CFG, attached, seq))
  cache = decode.init_cache(CFG, 2, 16)
  logits, cache = jax.jit(decode.prefill, static_argnums=0)(
      CFG, attached, seq[:, :6], jnp.array([6, 6], jnp.int32), cache)
  steps = [np.asarray(logits)]
  step = jax.jit(decode.decode_step, static_argnums=0)
  for t in range(6, 9):
    logits, cache = step(CFG, attached, jnp.asarray(seq[:, t]), cache)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.stack(steps, 1), full[:, 5:9],
                             **close(np.float32, CFG.intermediate_size, tree_scale(full)))


def test_gradients_reach_only_the_adapters(params):
  x = tokens(7)
  adapters = lora.init_adapters(CFG, SPEC, jax.random.key(1))

  def loss(adapters, base):
    return -jnp.mean(logprobs_lib.token_logprobs(CFG, lora.attach(base, adapters, SPEC), x[:, :-1],
                                                 x[:, 1:]))

  g_adapters, g_base = jax.jit(jax.grad(loss, argnums=(0, 1)))(adapters, params)
  assert jax.tree.structure(g_adapters) == jax.tree.structure(adapters)
  for t, g in g_adapters.items():
    assert not np.any(np.asarray(g["a"]))  # d/da (x a b) = 0 at b = 0
    assert np.abs(np.asarray(g["b"])).max() > 0
  # dL/db = scale * a^T dL/dW at the merged weights (W + scale a b): the chain rule, per layer
  adapters = random_adapters(CFG, SPEC, seed=8)
  g = jax.jit(jax.grad(loss))(adapters, params)
  merged = lora.merge(CFG, params, adapters, SPEC)
  g_full = jax.jit(jax.grad(lambda p: -jnp.mean(logprobs_lib.token_logprobs(CFG, p, x[:, :-1], x[:, 1:]))))(
      merged)
  for t in ("q_proj", "down_proj"):
    gw = np.asarray(g_full["layers"][t])
    a, b = np.asarray(adapters[t]["a"]), np.asarray(adapters[t]["b"])
    want_b = SPEC.scale * np.einsum("lir,lio->lro", a, gw)
    want_a = SPEC.scale * np.einsum("lio,lro->lir", gw, b)
    np.testing.assert_allclose(np.asarray(g[t]["b"]), want_b,
                               **close(np.float32, gw.shape[1], tree_scale(want_b)))
    np.testing.assert_allclose(np.asarray(g[t]["a"]), want_a,
                               **close(np.float32, gw.shape[2], tree_scale(want_a)))


def test_peft_names_and_round_trip(tmp_path):
  adapters = jax.device_get(random_adapters(CFG, SPEC))
  tensors = lora.to_peft_tensors(CFG, adapters)
  name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
  np.testing.assert_array_equal(tensors[name], adapters["q_proj"]["a"][1].T)  # [r, in]
  b_name = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
  assert tensors[b_name].shape == (CFG.hidden_size, 8)  # [out, r]
  assert len(tensors) == 2 * CFG.num_hidden_layers * len(lora.TARGETS)
  lora.save_peft(str(tmp_path / "adapter"), CFG, SPEC, adapters, base_model_name_or_path="/m")
  with open(tmp_path / "adapter" / "adapter_config.json") as f:
    conf = json.load(f)
  assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == (
      "LORA", 8, 16.0, "/m")
  assert conf["target_modules"] == list(lora.TARGETS)
  spec, loaded = lora.load_peft(str(tmp_path / "adapter"), CFG)
  assert spec == SPEC
  chex.assert_trees_all_equal(loaded, adapters)


def test_spec_errors_name_the_fix():
  with pytest.raises(ValueError, match=r"lora_rank=0 must be an integer >= 1"):
    lora.LoraSpec(0, 16.0)
  with pytest.raises(ValueError, match=r"lora_targets.*unknown \['qkv'\].*choose from"):
    lora.LoraSpec(8, 16.0, targets=("q_proj", "qkv"))
  with pytest.raises(ValueError, match=r"lora_alpha"):
    lora.LoraSpec(8, 0.0)
  with pytest.raises(ValueError, match=r"lora_dtype"):
    lora.LoraSpec(8, 1.0, dtype="float16")
  assert [lora.vllm_max_lora_rank(r) for r in (1, 2, 8, 12, 64, 300, 512)] == [
      1, 8, 8, 16, 64, 320, 512]
  with pytest.raises(ValueError, match=r"vLLM serves LoRA ranks up to 512.*rollout.backend='jax'"):
    lora.vllm_max_lora_rank(600)


def test_config_validation_of_lora_keys():
  from jaxreplay.config import defaults, validation  # pylint: disable=g-import-not-at-top
  c = defaults.base_config()
  assert validation.lora_errors(c.model, c.rollout) == []  # off by default
  c.model.lora_rank = 8
  assert validation.lora_errors(c.model, c.rollout) == []
  c.model.lora_targets = ("q_proj", "wq")
  assert "unknown ['wq']" in " ".join(validation.lora_errors(c.model, c.rollout))
  c.model.lora_targets = lora.TARGETS
  c.model.lora_rank, c.rollout.backend = 1024, "vllm"
  assert "up to 512" in " ".join(validation.lora_errors(c.model, c.rollout))
  c.model.lora_rank, c.rollout.placement = 8, "ray"
  assert "rollout.placement='local'" in " ".join(validation.lora_errors(c.model, c.rollout))


def test_peft_export_loads_in_peft_with_our_logits(params, tmp_path):
  """WORKDIR/hf_adapter's format: `peft.PeftModel.from_pretrained(base, dir)` gives our logits."""
  torch = require("torch")
  require("transformers")
  peft = require("peft")
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  for spec in (SPEC, lora.LoraSpec(8, 16.0, rslora=True, targets=("q_proj", "o_proj", "up_proj"))):
    adapters = random_adapters(CFG, spec, seed=11)
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / f"adapter{spec.rslora}")
    hf_io.save_hf(CFG, jax.device_get(params), base_dir)
    lora.save_peft(adapter_dir, CFG, spec, jax.device_get(adapters), base_model_name_or_path=base_dir)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    x = np.asarray(tokens(9))
    with torch.no_grad():
      theirs = model(input_ids=torch.tensor(x, dtype=torch.long)).logits.numpy()
    ours = np.asarray(apply(CFG, lora.attach(params, adapters, spec), x))
    np.testing.assert_allclose(ours, theirs, **close(np.float32, CFG.intermediate_size,
                                                     tree_scale(theirs)))
    assert np.abs(ours - np.asarray(apply(CFG, params, x))).max() > 0.05  # the adapter matters
    # and PEFT's own merge equals ours
    merged = model.merge_and_unload().state_dict()
    ours_merged = jax.device_get(lora.merge(CFG, params, adapters, spec))
    np.testing.assert_allclose(ours_merged["layers"]["q_proj"][1],
                               merged["model.layers.1.self_attn.q_proj.weight"].numpy().T,
                               **close(np.float32, spec.rank, 1.0))
