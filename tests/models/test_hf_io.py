"""jaxreplay.models.hf_io against transformers' real checkpoints and loaders."""
import json
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxreplay.models import transformer
from jaxreplay.models import hf_io, presets
from jaxreplay.models.config import ModelConfig
from tests.helpers import tolerances
from tests.helpers.deps import require

torch = require("torch")
transformers = require("transformers")

_LLAMA3 = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}.items()))
_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
CFGS = {
    # head_dim 32 != hidden / heads = 16: the table must never derive head_dim.
    "qwen3_tied": presets.tiny(**_SMALL, head_dim=32),
    "qwen3_untied": presets.tiny(**_SMALL, head_dim=32, tie_word_embeddings=False),
    "qwen2": ModelConfig(model_type="qwen2", **_SMALL, head_dim=16, attention_bias=True,
                         qk_norm=False, tie_word_embeddings=False, rope_theta=1e6),
    "llama3": ModelConfig(model_type="llama", **_SMALL, head_dim=16, qk_norm=False,
                          tie_word_embeddings=True, rope_theta=5e5, rope_scaling=_LLAMA3,
                          rms_norm_eps=1e-5),
}


def _params(cfg, seed=0, dtype=jnp.float32):
  """Random params in init_params' layout (from jax.eval_shape: nothing compiles); norms near 1 and
  nonzero biases, so that no two leaves coincide and a swapped leaf changes the logits."""
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    x = 0.1 * rng.standard_normal(s.shape, dtype=np.float32)
    return jnp.asarray((x + 1 if path[-1].key.endswith("norm") else x).astype(dtype))

  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _assert_bit_equal(a, b):
  """Same structure, dtypes and bits."""
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
    np.testing.assert_array_equal(x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}"))


def _assert_logits_close(cfg, params, hf_model):
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11), dtype=np.int32)
  ours = np.asarray(transformer.apply(cfg, params, jnp.asarray(tokens)))
  with torch.no_grad():
    ref = hf_model(torch.from_numpy(tokens).long()).logits.float().numpy()
  scale = np.abs(ref).max()
  assert scale > 0.1  # logits must carry signal for the comparison to mean anything
  # JAX vs torch: each logit sums hidden_size-wide products in every layer, in another order.
  np.testing.assert_allclose(ours, ref, rtol=0, atol=tolerances.close(
      np.float32, cfg.hidden_size * cfg.num_hidden_layers, scale)["atol"])


def _torch_to_numpy(t):
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def _hf_from_pretrained(path):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CFGS))
def test_round_trip_bit_exact(tmp_path, name, dtype):
  cfg = CFGS[name].replace(param_dtype=np.dtype(dtype).name)
  params = _params(cfg, dtype=dtype)
  assert hf_io.param_shapes(cfg) == transformer.param_shapes(cfg)  # table == forward's layout
  sd = hf_io.to_hf_state_dict(cfg, params)
  assert list(sd) == hf_io.hf_names(cfg)
  assert ("lm_head.weight" in sd) == (not cfg.tie_word_embeddings)
  assert ("model.layers.0.self_attn.q_proj.bias" in sd) == cfg.attention_bias
  assert ("model.layers.1.self_attn.k_norm.weight" in sd) == cfg.qk_norm
  assert all(x.dtype == np.dtype(dtype) for x in sd.values())
  # HF layout: [out, in], one tensor per layer.
  q = cfg.num_attention_heads * cfg.head_dim
  assert sd["model.layers.1.self_attn.q_proj.weight"].shape == (q, cfg.hidden_size)
  np.testing.assert_array_equal(sd["model.layers.1.mlp.down_proj.weight"],
                                np.asarray(params["layers"]["down_proj"][1]).T)
  _assert_bit_equal(hf_io.from_hf_state_dict(cfg, sd), params)

  hf_io.save_hf(cfg, params, str(tmp_path / "m"))
  assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary directory left behind
  assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "generation_config.json",
                                                "model.safetensors"]
  with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}
    assert sorted(f.keys()) == sorted(sd)
  cfg2, params2 = hf_io.load_hf(str(tmp_path / "m"), dtype=dtype)
  assert cfg2 == cfg
  _assert_bit_equal(params2, params)
  cfg3, params3 = hf_io.load_hf(str(tmp_path / "m"), dtype=None)  # keep the checkpoint's dtype
  assert cfg3 == cfg
  _assert_bit_equal(params3, params)


def test_load_casts_and_save_casts(tmp_path):
  cfg = CFGS["qwen3_untied"]
  params = _params(cfg)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  hf_io.save_hf(cfg, params, str(tmp_path / "m"), dtype=jnp.bfloat16)  # f32 weights saved as bf16
  with open(tmp_path / "m" / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  cfg2, loaded = hf_io.load_hf(str(tmp_path / "m"), dtype=None)
  assert cfg2.param_dtype == "bfloat16"
  _assert_bit_equal(loaded, bf16)
  _, as_f32 = hf_io.load_hf(str(tmp_path / "m"))  # default dtype float32: exact bf16 -> f32 widening
  _assert_bit_equal(as_f32, jax.tree.map(lambda x: x.astype(jnp.float32), bf16))


# ---- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen2", "llama3"])
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, name):
  cfg = CFGS[name]
  params = _params(cfg)
  hf_io.save_hf(cfg, params, str(tmp_path / "m"))
  hf_model = _hf_from_pretrained(str(tmp_path / "m"))
  assert type(hf_model).__name__ == cfg.architecture
  hf_sd = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  ours = hf_io.to_hf_state_dict(cfg, params)
  if cfg.tie_word_embeddings:  # transformers exposes the tied head under its own name
    np.testing.assert_array_equal(hf_sd.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
  assert sorted(hf_sd) == sorted(ours)
  for k in ours:
    np.testing.assert_array_equal(hf_sd[k], ours[k], err_msg=k)
  _assert_logits_close(cfg, params, hf_model)


def _hf_native_model(name):
  """A random transformers model built from transformers' own config classes (not ours)."""
  common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  if name == "qwen3":
    config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
  elif name == "qwen2":
    config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
  else:
    config = transformers.LlamaConfig(
        **common, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():  # norms are ones and biases zeros at init: make every tensor distinct
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama"])
def test_transformers_save_pretrained_loads_with_same_logits(tmp_path, name):
  model = _hf_native_model(name)
  model.save_pretrained(str(tmp_path / "hf"))
  cfg, params = hf_io.load_hf(str(tmp_path / "hf"))
  assert cfg.architecture == type(model).__name__
  hf_sd = {k: v.numpy() for k, v in model.state_dict().items()}
  if cfg.tie_word_embeddings:
    hf_sd.pop("lm_head.weight")
  ours = hf_io.to_hf_state_dict(cfg, params)
  assert sorted(ours) == sorted(hf_sd)
  for k in ours:
    np.testing.assert_array_equal(ours[k], hf_sd[k], err_msg=k)
  _assert_logits_close(cfg, params, model)

  # The same model stored in bfloat16 by transformers loads bit-exactly.
  model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf_bf16"))
  cfg16, params16 = hf_io.load_hf(str(tmp_path / "hf_bf16"), dtype=None)
  assert cfg16.param_dtype == "bfloat16"
  ours16 = hf_io.to_hf_state_dict(cfg16, params16)
  for k, v in model.state_dict().items():
    if k in ours16:
      ref = _torch_to_numpy(v)
      np.testing.assert_array_equal(ours16[k].view(np.uint16), ref.view(np.uint16), err_msg=k)


def test_sharded_save_and_load(tmp_path):
  cfg = CFGS["qwen3_untied"]
  params = _params(cfg)
  sd = hf_io.to_hf_state_dict(cfg, params)
  limit = 40_000
  hf_io.save_hf(cfg, params, str(tmp_path / "m"), max_shard_bytes=limit)
  files = sorted(os.listdir(tmp_path / "m"))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert "model.safetensors" not in files and len(shards) >= 3
  n = len(shards)
  assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
  with open(tmp_path / "m" / "model.safetensors.index.json") as f:
    index = json.load(f)
  assert index["metadata"]["total_size"] == sum(x.nbytes for x in sd.values())
  assert sorted(index["weight_map"]) == sorted(sd) and set(index["weight_map"].values()) == set(shards)
  for shard in shards:
    with safe_open(str(tmp_path / "m" / shard), framework="numpy") as f:
      names = list(f.keys())
      assert f.metadata() == {"format": "pt"}
      assert all(index["weight_map"][k] == shard for k in names)
      size = sum(sd[k].nbytes for k in names)
      assert size <= limit or len(names) == 1
  cfg2, params2 = hf_io.load_hf(str(tmp_path / "m"))
  assert cfg2 == cfg
  _assert_bit_equal(params2, params)
  hf_model = _hf_from_pretrained(str(tmp_path / "m"))  # transformers accepts the index
  np.testing.assert_array_equal(hf_model.state_dict()["lm_head.weight"].numpy(), sd["lm_head.weight"])


@pytest.mark.parametrize("name", ["qwen3_tied", "llama3"])
@pytest.mark.parametrize("style", ["top_level_rope_theta", "rope_parameters_only"])
def test_config_rope_styles(tmp_path, name, style):
  cfg = CFGS[name]
  hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m"))
  path = tmp_path / "m" / "config.json"
  d = json.loads(path.read_text())
  if style == "top_level_rope_theta":  # transformers 4.x
    d.pop("rope_parameters")
    assert "rope_theta" in d and ("rope_scaling" in d) == (cfg.rope_scaling is not None)
  else:  # transformers 5.x
    d.pop("rope_theta")
    d.pop("rope_scaling", None)
  path.write_text(json.dumps(d))
  cfg2, _ = hf_io.load_hf(str(tmp_path / "m"))
  assert cfg2 == cfg


@pytest.mark.parametrize("name", ["qwen3_untied", "qwen2"])
def test_config_without_tie_key_is_untied_like_transformers(tmp_path, name):
  cfg = CFGS[name]
  hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m"))
  path = tmp_path / "m" / "config.json"
  d = json.loads(path.read_text())
  d.pop("tie_word_embeddings")
  path.write_text(json.dumps(d))
  assert not transformers.AutoConfig.from_pretrained(str(tmp_path / "m")).tie_word_embeddings
  assert hf_io.load_hf(str(tmp_path / "m"))[0] == cfg


def test_load_with_shardings_on_mesh(tmp_path):
  assert jax.device_count() == 8
  cfg = CFGS["qwen3_untied"]
  params = _params(cfg)
  hf_io.save_hf(cfg, params, str(tmp_path / "m"))
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = {"embed_tokens": P("model", None), "norm": P(), "lm_head": P(None, "model"),
           "layers": {k: P("data", None) for k in ("input_layernorm", "post_attention_layernorm",
                                                   "q_norm", "k_norm")}}
  for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
    specs["layers"][k] = P("data", None, "model")
  for k in ("o_proj", "down_proj"):
    specs["layers"][k] = P(None, "model", "data")
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  _, loaded = hf_io.load_hf(str(tmp_path / "m"), shardings=shardings)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings)):
    assert got.sharding == want
  _assert_bit_equal(loaded, params)
  _, replicated = hf_io.load_hf(str(tmp_path / "m"), dtype=jnp.bfloat16,
                                shardings=NamedSharding(mesh, P()))
  assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(replicated))
  _assert_bit_equal(replicated, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  with pytest.raises(ValueError, match="shardings has no leaf 'lm_head'"):
    hf_io.load_hf(str(tmp_path / "m"), shardings={k: v for k, v in shardings.items()
                                                   if k != "lm_head"})


def test_save_overwrites_atomically_and_failures_leave_old_dir(tmp_path):
  cfg = CFGS["qwen3_tied"]
  out = str(tmp_path / "m")
  hf_io.save_hf(cfg, _params(cfg, seed=0), out)
  new = _params(cfg, seed=5)
  hf_io.save_hf(cfg, new, out)
  _assert_bit_equal(hf_io.load_hf(out)[1], new)
  assert sorted(os.listdir(tmp_path)) == ["m"]
  with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
    hf_io.save_hf(cfg, _params(cfg, seed=9), out, tokenizer_dir=str(tmp_path / "no_such_tokenizer"))
  assert sorted(os.listdir(tmp_path)) == ["m"]
  _assert_bit_equal(hf_io.load_hf(out)[1], new)


def test_tokenizer_files_copied(tmp_path):
  tokenizers = require("tokenizers")
  chars = list("abcdefghij +=0123456789")
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(pattern="", behavior="isolated")
  tok.decoder = tokenizers.decoders.Fuse()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                              pad_token="<pad>", unk_token="<unk>")
  fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  tok_dir = tmp_path / "tok"
  fast.save_pretrained(str(tok_dir))
  cfg = CFGS["qwen3_tied"]
  hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m"), tokenizer_dir=str(tok_dir))
  copied = [n for n in hf_io.TOKENIZER_FILES if (tok_dir / n).is_file()]
  assert "tokenizer.json" in copied and "tokenizer_config.json" in copied
  for n in copied:
    assert (tmp_path / "m" / n).read_bytes() == (tok_dir / n).read_bytes()
  reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m"))
  assert reloaded("ab 12")["input_ids"] == fast("ab 12")["input_ids"]
  assert reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="has none of the tokenizer files"):
    hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m2"), tokenizer_dir=str(tmp_path / "empty"))


# ---- errors -----------------------------------------------------------------------------------


def _saved(tmp_path, name="qwen3_tied", **kwargs):
  cfg = CFGS[name]
  params = _params(cfg)
  out = tmp_path / "m"
  hf_io.save_hf(cfg, params, str(out), **kwargs)
  return cfg, params, out


def _rewrite(out, edit):
  """Rewrites model.safetensors with `edit(state_dict)` applied."""
  path = str(out / "model.safetensors")
  with safe_open(path, framework="numpy") as f:
    sd = {k: f.get_tensor(k) for k in f.keys()}
  edit(sd)
  save_file(sd, path, metadata={"format": "pt"})


def _edit_config(out, **changes):
  d = json.loads((out / "config.json").read_text())
  d.update(changes)
  (out / "config.json").write_text(json.dumps(d))


def test_error_missing_config(tmp_path):
  _, _, out = _saved(tmp_path)
  os.remove(out / "config.json")
  with pytest.raises(FileNotFoundError, match=r"m/config\.json not found"):
    hf_io.load_hf(str(out))


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "unsupported model_type 'mistral'"),
    (dict(architectures=["LlamaForCausalLM"]), "does not match model_type='qwen3'"),
])
def test_error_unsupported_architecture(tmp_path, changes, match):
  _, _, out = _saved(tmp_path)
  _edit_config(out, **changes)
  with pytest.raises(ValueError, match=match) as e:
    hf_io.load_hf(str(out))
  assert "config.json" in str(e.value)


def test_error_no_safetensors(tmp_path):
  _, _, out = _saved(tmp_path)
  os.remove(out / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors") as e:
    hf_io.load_hf(str(out))
  assert "converted" not in str(e.value)
  (out / "pytorch_model.bin").write_bytes(b"\0")
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*must be converted"):
    hf_io.load_hf(str(out))


def _missing(sd):
  del sd["model.layers.1.mlp.up_proj.weight"]


def _extra(sd):
  sd["model.layers.0.mlp.gate_proj.bias"] = np.zeros(96, np.float32)


def _transposed(sd):
  k = "model.layers.0.self_attn.q_proj.weight"
  sd[k] = np.ascontiguousarray(sd[k].T)


def _int(sd):
  sd["model.norm.weight"] = sd["model.norm.weight"].astype(np.int32)


def _half(sd):
  sd["model.layers.1.input_layernorm.weight"] = sd["model.layers.1.input_layernorm.weight"].astype(
      np.float16)


def _untied_head(sd):
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1


@pytest.mark.parametrize("edit,match", [
    (_missing, r"1 tensor\(s\) .* missing, e.g. \['model.layers.1.mlp.up_proj.weight'\]"),
    (_extra, r"unexpected tensor\(s\), e.g. \[\('model.layers.0.mlp.gate_proj.bias', '.*model.safetensors'"),
    (_transposed, r"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' has shape "
                  r"\(64, 128\), expected \(128, 64\)"),
    (_int, "model.safetensors: tensor 'model.norm.weight' has dtype int32"),
    (_half, r"model.safetensors: tensor\(s\) \[\('model.layers.1.input_layernorm.weight', 'float16'\)\] "
            r"differ in dtype from the other tensors \(float32\)"),
    (_untied_head, "tie_word_embeddings=true but 'lm_head.weight' differs"),
], ids=["missing", "extra", "shape", "int_dtype", "mixed_dtype", "tied_head_differs"])
def test_error_bad_tensors(tmp_path, edit, match):
  _, _, out = _saved(tmp_path)
  _rewrite(out, edit)
  with pytest.raises(ValueError, match=match):
    hf_io.load_hf(str(out))


def test_tied_head_equal_to_embedding_is_ignored(tmp_path):
  cfg, params, out = _saved(tmp_path)
  _rewrite(out, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].copy()}))
  _assert_bit_equal(hf_io.load_hf(str(out))[1], params)
  # Old checkpoints' rotary buffers are derived from config.json and skipped too.
  _rewrite(out, lambda sd: sd.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                      np.ones(16, np.float32)}))
  _assert_bit_equal(hf_io.load_hf(str(out))[1], params)


def test_error_index_problems(tmp_path):
  _, _, out = _saved(tmp_path, max_shard_bytes=40_000)
  index_path = out / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  name, shard = sorted(index["weight_map"].items())[0]
  other = next(s for s in index["weight_map"].values() if s != shard)
  index["weight_map"][name] = other
  index_path.write_text(json.dumps(index))
  with pytest.raises(ValueError, match=f"index.json: weight_map puts '{name}' in {other}, but it is in"):
    hf_io.load_hf(str(out))
  os.remove(out / shard)
  with pytest.raises(FileNotFoundError, match=f"index.json lists shard '{shard}'"):
    hf_io.load_hf(str(out))
  index_path.write_text("{not json")
  with pytest.raises(ValueError, match="index.json: not a valid safetensors index"):
    hf_io.load_hf(str(out))


def test_error_corrupt_safetensors(tmp_path):
  _, _, out = _saved(tmp_path)
  (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
  with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
    hf_io.load_hf(str(out))


def test_error_state_dict_and_params(tmp_path):
  cfg = CFGS["qwen2"]
  params = _params(cfg)
  sd = hf_io.to_hf_state_dict(cfg, params)
  del sd["model.layers.0.self_attn.v_proj.bias"]
  with pytest.raises(ValueError, match=r"state_dict: 1 tensor\(s\).*v_proj.bias"):
    hf_io.from_hf_state_dict(cfg, sd)
  bad = dict(params, layers={k: v for k, v in params["layers"].items() if k != "q_bias"})
  with pytest.raises(ValueError, match="params has no leaf 'layers/q_bias'"):
    hf_io.save_hf(cfg, bad, str(tmp_path / "m"))
  bad = dict(params, norm=params["norm"][:-1])
  with pytest.raises(ValueError, match=r"leaf 'norm' has shape \(63,\), expected \(64,\)"):
    hf_io.save_hf(cfg, bad, str(tmp_path / "m"))
  bad = dict(params, extra=params["norm"])
  with pytest.raises(ValueError, match=r"params has leaves \['extra'\]"):
    hf_io.save_hf(cfg, bad, str(tmp_path / "m"))
  mixed = dict(params, norm=params["norm"].astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"params mix dtypes .*pass save_hf\(\.\.\., dtype=\.\.\.\)"):
    hf_io.save_hf(cfg, mixed, str(tmp_path / "m"))
  assert os.listdir(tmp_path) == []  # failed saves write nothing
  with pytest.raises(ValueError, match="attention_bias=True with model_type='llama'"):
    hf_io.to_hf_state_dict(CFGS["llama3"].replace(attention_bias=True), {})


def test_save_hf_keeps_every_eos_id_of_the_source_generation_config(tmp_path):
  """An export of a Llama-3.2-Instruct-like run keeps the source's three eos ids (not just one)."""
  transformers = require("transformers")
  tokenizers = require("tokenizers")
  cfg = CFGS["qwen3_tied"]
  src = tmp_path / "src"
  src.mkdir()
  word_level = tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(word_level),
                                              unk_token="<unk>", eos_token="<unk>")
  fast.save_pretrained(str(src))
  gen = {"bos_token_id": 1, "eos_token_id": [7, 8, 9], "temperature": 0.6, "do_sample": True}
  (src / "generation_config.json").write_text(json.dumps(gen))
  hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m"), tokenizer_dir=str(src))
  out = json.loads((tmp_path / "m" / "generation_config.json").read_text())
  assert out["eos_token_id"] == [7, 8, 9] + ([cfg.eos_token_id] if cfg.eos_token_id not in
                                              (7, 8, 9) and cfg.eos_token_id is not None else [])
  assert out["temperature"] == 0.6 and out["do_sample"] is True
  # Without a source file the config's own ids are written, as before.
  hf_io.save_hf(cfg, _params(cfg), str(tmp_path / "m2"))
  out2 = json.loads((tmp_path / "m2" / "generation_config.json").read_text())
  assert out2.get("eos_token_id") == cfg.eos_token_id
