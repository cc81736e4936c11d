"""Tokenizer and model directories as users have them, built without the hub: one token per
printable ASCII character plus a model's special tokens at their real ids (tests/tasks/)."""
import json
import os

CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
CHAR_ID = {c: i + 1 for i, c in enumerate(CHARS)}  # 0 is <unk>


def write_tokenizer(out_dir, special, plain, template, **tokens):
  """A fast HF tokenizer in `out_dir`: characters, `special` / `plain` added tokens at their ids,
  `template` as its chat template, bos/eos/pad from `tokens`."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {"<unk>": 0, **CHAR_ID, **special, **plain}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                               clean_up_tokenization_spaces=False, **tokens)
  if template is not None:
    hf.chat_template = template
  hf.save_pretrained(out_dir)


def write_model_dir(out_dir, model_type, config, generation):
  """config.json (a 1-layer model of `model_type` with the real vocab and token ids) and
  generation_config.json: what `build.model_config` and `tokenizer.model_eos_ids` read."""
  from jaxreplay.models.config import ModelConfig
  cfg = ModelConfig(model_type=model_type, vocab_size=config["vocab_size"], hidden_size=16,
                    intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, qk_norm=model_type == "qwen3")
  d = dict(cfg.to_hf_dict(), **config)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(d, f)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation, f)
