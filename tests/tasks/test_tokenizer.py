"""Tokenizers as users have them: Qwen3 and Llama-3.2-Instruct special tokens, chat templates and
eos ids, built in the test (no hub), through `TextCodec` and the build-level checks; the character
tokenizer of the procedural tasks (`tasks.tokenizer`).

The tokenizers have one token per printable ASCII character plus the models' special tokens at
their real ids, so the expected prompt ids are written down here piece by piece, independently of
the template engine and of the tokenizers library.
"""
import json

import numpy as np
import pytest

from jaxreplay.config import validation
from jaxreplay.models.config import ModelConfig
from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import tokenizer as tok_lib
from tests.helpers.chat_templates import LLAMA3_2_INSTRUCT, QWEN3
from tests.helpers.deps import require
from tests.helpers.tokenizer_files import CHAR_ID, write_model_dir, write_tokenizer

transformers = require("transformers")


# Qwen3-0.6B ... Qwen3-8B (hybrid thinking): tokenizer eos <|im_end|>, pad <|endoftext|>, no bos.
QWEN3_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN3_PLAIN = {"<think>": 151667, "</think>": 151668}   # added tokens, not special: decoded
QWEN3_CONFIG = dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645)
QWEN3_GENERATION = dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643)
# Llama-3.2-1B/3B-Instruct: tokenizer eos <|eot_id|>; the model's eos ids are three.
LLAMA_SPECIAL = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                 "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
                 "<|eom_id|>": 128008, "<|eot_id|>": 128009}
LLAMA_EOS = [128001, 128008, 128009]
LLAMA_CONFIG = dict(vocab_size=128256, bos_token_id=128000, eos_token_id=LLAMA_EOS)
LLAMA_GENERATION = dict(bos_token_id=128000, eos_token_id=LLAMA_EOS)

TEXT = "What is 2 + 2?\nPlease reason step by step, and put your final answer within \\boxed{}."


def ids(*pieces):
  """The reference ids: a special / added token's id, else one id per character."""
  table = {**QWEN3_SPECIAL, **QWEN3_PLAIN, **LLAMA_SPECIAL}
  out = []
  for piece in pieces:
    out.extend([table[piece]] if piece in table else [CHAR_ID[c] for c in piece])
  return out


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("qwen3"))
  write_tokenizer(out, QWEN3_SPECIAL, QWEN3_PLAIN, QWEN3, eos_token="<|im_end|>",
                  pad_token="<|endoftext|>")
  write_model_dir(out, "qwen3", QWEN3_CONFIG, QWEN3_GENERATION)
  return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("llama"))
  write_tokenizer(out, LLAMA_SPECIAL, {}, LLAMA3_2_INSTRUCT, bos_token="<|begin_of_text|>",
                  eos_token="<|eot_id|>")
  write_model_dir(out, "llama", LLAMA_CONFIG, LLAMA_GENERATION)
  return out


# ---- eos ids --------------------------------------------------------------------------------


def test_model_eos_ids_union_of_generation_config_and_config(tmp_path):
  def write(name, eos):
    with open(tmp_path / name, "w") as f:
      json.dump({} if eos is None else {"eos_token_id": eos}, f)
  assert tok_lib.model_eos_ids(str(tmp_path)) == ()  # neither file
  write("config.json", 151645)
  assert tok_lib.model_eos_ids(str(tmp_path)) == (151645,)
  write("generation_config.json", [151645, 151643])
  assert tok_lib.model_eos_ids(str(tmp_path)) == (151645, 151643)
  write("config.json", [7, 151643, 8])
  assert tok_lib.model_eos_ids(str(tmp_path)) == (151645, 151643, 7, 8)
  write("generation_config.json", None)
  assert tok_lib.model_eos_ids(str(tmp_path)) == (7, 151643, 8)
  write("config.json", "2")
  with pytest.raises(ValueError, match=r"config.json: eos_token_id='2' must be an int or a list"):
    tok_lib.model_eos_ids(str(tmp_path))


# ---- Qwen3 ----------------------------------------------------------------------------------


def test_qwen3_codec_prompt_ids_stop_ids_and_thinking(qwen3_dir):
  codec = tok_lib.load_tokenizer(qwen3_dir, use_chat_template="auto")
  assert codec.use_chat_template  # the tokenizer ships a template
  assert (codec.eos_id, codec.pad_id, codec.bos_id) == (151645, 151643, None)
  assert codec.stop_ids == (151645, 151643)  # tokenizer eos + generation_config's list
  assert codec.vocab_size == 151669
  prompt = ids("<|im_start|>", "user\n" + TEXT, "<|im_end|>", "\n", "<|im_start|>", "assistant\n")
  got = codec.encode_prompt(TEXT)
  assert got.dtype == np.int32
  assert got.tolist() == prompt
  no_think = tok_lib.load_tokenizer(qwen3_dir, use_chat_template="on",
                                    chat_template_kwargs={"enable_thinking": False})
  assert no_think.encode_prompt(TEXT).tolist() == prompt + ids("<think>", "\n\n", "</think>",
                                                              "\n\n")
  off = tok_lib.load_tokenizer(qwen3_dir, use_chat_template="off")
  assert off.encode_prompt(TEXT).tolist() == ids(TEXT)  # no bos: Qwen has none


def test_qwen3_completion_stopping_at_either_eos_decodes_right(qwen3_dir):
  from jaxreplay.tasks import rewards  # pylint: disable=g-import-not-at-top
  codec = tok_lib.load_tokenizer(qwen3_dir, use_chat_template="auto")
  answer = "<think>\n2 + 2 = 4\n</think>\n\nThe answer is \\boxed{4}."
  body = ids("<think>", "\n2 + 2 = 4\n", "</think>", "\n\nThe answer is \\boxed{4}.")
  for stop in (151645, 151643):
    text = codec.decode(body + [stop] + ids("junk", "<|im_start|>"))
    assert text == answer, stop
    assert rewards.math_verify_reward(text, "4") == 1.0
  # A base model's completion ends with <|endoftext|>, which the tokenizer's eos alone missed.
  only_tokenizer_eos = tok_lib.TextCodec(codec.tokenizer)
  assert only_tokenizer_eos.stop_ids == (151645,)
  assert only_tokenizer_eos.decode(body + [151643] + ids("junk")) == answer + "junk"


# ---- Llama-3.2-Instruct -------------------------------------------------------------------


def llama_prompt(date):
  return ids("<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>",
             f"\n\nCutting Knowledge Date: December 2023\nToday Date: {date}\n\n", "<|eot_id|>",
             "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n" + TEXT, "<|eot_id|>",
             "<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n")


def test_llama_codec_prompt_ids_and_stop_ids(llama_dir):
  codec = tok_lib.load_tokenizer(llama_dir, use_chat_template="auto",
                                 chat_template_kwargs={"date_string": "26 Jul 2024"})
  assert codec.use_chat_template
  assert (codec.eos_id, codec.pad_id, codec.bos_id) == (128009, 128009, 128000)  # pad: eos
  assert codec.stop_ids == (128009, 128001, 128008)
  got = codec.encode_prompt("  " + TEXT + " \n")  # the template trims the message
  assert got.tolist() == llama_prompt("26 Jul 2024")  # one bos: the template's
  off = tok_lib.load_tokenizer(llama_dir, use_chat_template="off")
  assert off.encode_prompt(TEXT).tolist() == ids("<|begin_of_text|>", TEXT)
  for stop in LLAMA_EOS:
    assert codec.decode(ids("\\boxed{4}") + [stop] + ids("more")) == "\\boxed{4}"
  assert codec.decode(ids("\\boxed{4}", "<|start_header_id|>")) == "\\boxed{4}"  # special: skipped


# ---- the build-level checks ----------------------------------------------------------------


def _config(model_dir, data_path, chat_template="auto"):
  from jaxreplay.config.defaults import base_config  # pylint: disable=g-import-not-at-top
  c = base_config()
  c.model.path = model_dir
  c.model.chat_template = chat_template
  c.model.max_len = 256
  c.task.name = "math"
  c.task.path = data_path
  c.task.template = "qwen_math"
  return c


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_build_accepts_the_models_tokenizers(family, qwen3_dir, llama_dir, tmp_path):
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import prompt_check  # pylint: disable=g-import-not-at-top
  model_dir = qwen3_dir if family == "qwen3" else llama_dir
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)})
                          + "\n" for i in range(40)))
  c = _config(model_dir, str(data))
  validation.validate_config(c)
  task = build.make_task(c.task)
  try:
    codec, tok_dir = build.load_codec(c, task, str(tmp_path))
    assert tok_dir == model_dir and codec.use_chat_template
    model_cfg = build.model_config(c, codec)  # runs check_tokenizer_matches_model
    assert model_cfg.eos_token_id == (151645 if family == "qwen3" else 128001)
    expected_stops = {151645, 151643} if family == "qwen3" else set(LLAMA_EOS)
    assert set(codec.stop_ids) == expected_stops
    prompt_check.check_task_prompts(task, codec, prompt_check.Context(c.model.max_len,
                                                                      c.rollout.max_tokens))
    if family == "llama":
      # ModelConfig keeps the first of the three eos ids (128001), which the tokenizer's own eos
      # (128009) alone does not cover: what failed before generation_config's ids were added.
      with pytest.raises(ValueError, match="eos_token_id=128001"):
        tok_lib.check_tokenizer_matches_model(tok_lib.TextCodec(codec.tokenizer), model_cfg)
    plain = build.load_codec(_config(model_dir, str(data), "off"), task, str(tmp_path))[0]
    assert not plain.use_chat_template
    if family == "qwen3":
      c.model.chat_template_kwargs = '{"enable_thinking": false}'
      validation.validate_config(c)
      no_think = build.load_codec(c, task, str(tmp_path))[0]
      prompt = codec.encode_prompt(TEXT).tolist()
      assert no_think.encode_prompt(TEXT).tolist() == prompt + ids("<think>", "\n\n", "</think>",
                                                                  "\n\n")
  finally:
    task.close()


def test_chat_template_modes_and_errors(tmp_path):
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  char_dir = str(tmp_path / "chars")
  tok_lib.build_char_tokenizer("0123456789+=", char_dir)
  assert not tok_lib.load_tokenizer(char_dir, use_chat_template="auto").use_chat_template
  with pytest.raises(ValueError, match="has no chat_template: set model.chat_template='off'"):
    tok_lib.load_tokenizer(char_dir, use_chat_template="on")
  with pytest.raises(ValueError, match=r"model.chat_template='yes': expected one of"):
    tok_lib.load_tokenizer(char_dir, use_chat_template="yes")
  assert tok_lib.use_chat_template_mode(True, None)
  assert not tok_lib.use_chat_template_mode(False, None)
  c = _config("", "")
  c.task.name = "arithmetic"
  c.model.chat_template = "yes"
  c.model.chat_template_kwargs = "enable_thinking=False"
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  assert "model.chat_template='yes': expected one of ('auto'" in str(e.value)
  assert "model.chat_template_kwargs='enable_thinking=False' is not valid JSON" in str(e.value)
  c.model.chat_template = "off"
  c.model.chat_template_kwargs = "[1]"
  with pytest.raises(ValueError, match="must be a JSON object of template variables"):
    validation.validate_config(c)


# ---- the character tokenizer of the procedural tasks -------------------------------------------

TEXTS = ["12+7=19", " 1  2 \n3 ", "", "99*99=9801\n\n", "0-0="]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tok"))
  tok_lib.build_char_tokenizer(arithmetic.ArithmeticTask().charset, out_dir=out)
  return out


def test_char_tokenizer_ids_and_round_trip(char_dir):
  hf = tok_lib.build_char_tokenizer("ab c\n")
  assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
  assert hf("ab c\nb")["input_ids"] == [1, 4, 5, 6, 7, 8, 5]  # <bos> then one id per char
  for text in ["ab c\nb", "  a", "c\n\n", ""]:
    ids = hf(text)["input_ids"]
    assert hf.decode(ids, skip_special_tokens=True) == text
  assert hf("azb", add_special_tokens=False)["input_ids"] == [4, 3, 5]  # z -> <unk>


def test_saved_char_tokenizer_loads_with_autotokenizer(char_dir):
  auto = transformers.AutoTokenizer.from_pretrained(char_dir)
  direct = tok_lib.build_char_tokenizer(arithmetic.ArithmeticTask().charset)
  for text in TEXTS:
    assert auto(text)["input_ids"] == direct(text)["input_ids"]
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text
  assert len(auto) == 4 + len(set(arithmetic.ArithmeticTask().charset))


def test_text_codec(char_dir):
  codec = tok_lib.load_tokenizer(char_dir)
  assert (codec.pad_id, codec.bos_id, codec.eos_id, codec.stop_ids) == (0, 1, 2, (2,))
  assert codec.vocab_size == len(codec.tokenizer)
  for text in TEXTS:
    ids = codec.encode(text)
    assert ids.dtype == np.int32 and ids[0] == codec.bos_id and len(ids) == len(text) + 1
    assert codec.decode(ids) == text
    assert codec.decode(codec.encode(text, add_bos=False)) == text
  # decode stops at the first eos and drops what follows.
  ids = np.concatenate([codec.encode("12", add_bos=False), [codec.eos_id],
                        codec.encode("34", add_bos=False)])
  assert codec.decode(ids) == "12"
  assert codec.decode(codec.encode("7").tolist() + [codec.pad_id]) == "7"


def test_text_codec_chat_template(char_dir):
  hf = transformers.AutoTokenizer.from_pretrained(char_dir)
  hf.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
  codec = tok_lib.TextCodec(hf, use_chat_template=True)
  assert codec.decode(codec.encode_prompt("1+2")) == "1+2="
  with pytest.raises(ValueError, match="chat_template"):
    tok_lib.TextCodec(transformers.AutoTokenizer.from_pretrained(char_dir), use_chat_template=True)


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tok_lib.load_tokenizer(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="no tokenizer files"):
    tok_lib.load_tokenizer(str(tmp_path))


def test_check_tokenizer_matches_model(char_dir):
  codec = tok_lib.load_tokenizer(char_dir)
  cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4, eos_token_id=2)
  tok_lib.check_tokenizer_matches_model(codec, cfg)
  tok_lib.check_tokenizer_matches_model(codec.tokenizer, cfg.replace(eos_token_id=None))
  with pytest.raises(ValueError, match="vocab_size is 8"):
    tok_lib.check_tokenizer_matches_model(codec, cfg.replace(vocab_size=8))
  with pytest.raises(ValueError, match="eos_token_id=5"):
    tok_lib.check_tokenizer_matches_model(codec, cfg.replace(eos_token_id=5))
