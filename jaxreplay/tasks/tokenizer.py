"""Tokenizers: a character-level HF tokenizer for the procedural tasks, and `TextCodec`.

`TextCodec` is the one text <-> token-id interface the pipeline uses for every task: it wraps any
Hugging Face tokenizer directory (a real model's, or one written by `build_char_tokenizer`).
`transformers` (and `jaxreplay.models`, for the one list of tokenizer file names) are imported on
first use only, so that importing `jaxreplay.tasks` stays cheap (reward worker processes import this
package).

The trainer process never imports torch (on GPU a second libcudnn.so.9 beside JAX's): `transformers.
AutoTokenizer` does (its auto classes import the generation config, which imports torch when it is
installed, as on every GPU install), so `load_tokenizer` reads a directory with a tokenizer.json
through `PreTrainedTokenizerFast` (in transformers 5 `TokenizersBackend`: the class AutoTokenizer
returns for Llama-3.x and the base of its Qwen2Tokenizer for Qwen3; the same ids and chat-template
prompts, tests/integration/test_gpu_path.py) and keeps AutoTokenizer only for directories without one (slow /
sentencepiece-only tokenizers). And
transformers is imported without its "PyTorch was not found" advice (`_transformers`): the trainer
only needs its tokenizers.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3 in a char tokenizer
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# `model.chat_template`: "auto" applies the tokenizer's chat template when it ships one.
CHAT_TEMPLATE_MODES = ("auto", "on", "off")


_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def _transformers():
  """The transformers module, imported (the first time) without its one-off "PyTorch was not
  found. Models won't be available..." advice, which a trainer without torch (`pip install -e .`)
  would print at every start: the trainer only uses its tokenizers. The variable is set for the
  import only; later advisory warnings still show."""
  module = sys.modules.get("transformers")
  if module is not None:
    return module
  prior = os.environ.get(_NO_ADVICE)
  os.environ[_NO_ADVICE] = "1"
  try:
    import transformers  # pylint: disable=g-import-not-at-top
  finally:
    if prior is None:
      os.environ.pop(_NO_ADVICE, None)
    else:
      os.environ[_NO_ADVICE] = prior
  return transformers


def hf_tokenizer_from_dir(path: str):
  """The HF tokenizer of directory `path` without importing torch: `PreTrainedTokenizerFast` when
  it has a tokenizer.json, else `AutoTokenizer` (which imports torch when it is installed)."""
  transformers = _transformers()
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)
  return transformers.AutoTokenizer.from_pretrained(path)


def build_char_tokenizer(chars: Sequence[str], out_dir: Optional[str] = None):
  """A `transformers.PreTrainedTokenizerFast` with one token per character.

  Ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then `chars` in order (duplicates dropped). Encoding with
  special tokens prepends <bos>; decoding fuses characters back, so any text over `chars` round-trips
  exactly (spaces and newlines included). Characters outside `chars` encode to <unk>.
  When `out_dir` is given the tokenizer is saved there (`load_tokenizer` loads it).
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  PreTrainedTokenizerFast = _transformers().PreTrainedTokenizerFast  # pylint: disable=invalid-name

  chars = list(chars)
  bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
  if bad:
    raise ValueError(f"build_char_tokenizer: every entry must be one character, got {bad[:5]!r}")
  if not chars:
    raise ValueError("build_char_tokenizer: `chars` is empty")
  vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
  for c in chars:
    if c not in vocab:
      vocab[c] = len(vocab)
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)])
  hf = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
      unk_token="<unk>", clean_up_tokenization_spaces=False)
  if out_dir is not None:
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
  return hf


class TextCodec:
  """Text <-> int32 token ids over a Hugging Face tokenizer.

  Attributes:
    tokenizer: the wrapped HF tokenizer.
    vocab_size: 1 + the largest id the tokenizer can emit (base vocab + added tokens).
    eos_id: the end-of-sequence id (generation stops there).
    stop_ids: all ids that end a completion (eos plus `extra_stop_ids`), a tuple for SamplingParams.
    pad_id: padding id (falls back to eos_id when the tokenizer has no pad token, as Qwen's).
    bos_id: prepended by `encode` when not None (Qwen tokenizers have none).
    use_chat_template: `encode_prompt` wraps text as a user turn of the tokenizer's chat template.
    chat_template_kwargs: extra variables of the template (e.g. Qwen3's `enable_thinking=False`,
      Llama-3's `date_string`, which otherwise is today's date).
  """

  def __init__(self, tokenizer: Any, extra_stop_ids: Sequence[int] = (),
               use_chat_template: bool = False,
               chat_template_kwargs: Optional[Mapping[str, Any]] = None):
    self.tokenizer = tokenizer
    eos = tokenizer.eos_token_id
    if eos is None:
      raise ValueError("tokenizer has no eos token: set `eos_token` in its tokenizer_config.json "
                       "(generation needs a stop token)")
    self.eos_id = int(eos)
    self.stop_ids = tuple(dict.fromkeys([self.eos_id] + [int(i) for i in extra_stop_ids]))
    self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
    # The id range, not the count: ids must index the embedding table, and a vocabulary may skip
    # ids (equal to len(tokenizer) for the usual contiguous ones).
    self.vocab_size = max(int(len(tokenizer)), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if use_chat_template and not has_chat_template(tokenizer):
      raise ValueError("use_chat_template=True but the tokenizer has no chat_template: set "
                       "model.chat_template='off' (or 'auto'), or use a tokenizer that ships one "
                       "(`chat_template` in tokenizer_config.json, or chat_template.jinja)")
    self.use_chat_template = bool(use_chat_template)
    self.chat_template_kwargs = dict(chat_template_kwargs or {})

  def encode(self, text: str, add_bos: bool = True) -> np.ndarray:
    """int32 [L] ids of `text`, with bos_id first when `add_bos` and the tokenizer has one."""
    ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id] + list(ids)
    return np.asarray(ids, dtype=np.int32)

  def encode_prompt(self, text: str) -> np.ndarray:
    """int32 [L] ids of a task prompt: through the chat template (as one user message, with the
    generation prompt) when `use_chat_template`, else `encode(text)`."""
    if not self.use_chat_template:
      return self.encode(text)
    return self.encode(self.render_chat(text), add_bos=False)

  def render_chat(self, text: str) -> str:
    """`text` as one user message of the chat template, with the assistant's generation prompt
    (the template writes any bos token itself)."""
    return self.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
        **self.chat_template_kwargs)

  # Stands in for a policy turn when the chat template renders the turn around an observation.
  _TURN_SENTINEL = "JAXREPLAY-POLICY-TURN-7f3a"

  def encode_observation(self, text: str, role: str = "tool") -> np.ndarray:
    """int32 [L] ids of an environment's observation between two policy turns (multi-turn
    trajectories): the text itself without a chat template (no bos); with one
    (`render_observation`), everything the template writes between the end-of-turn token the
    policy generated and the policy's next turn, around `text` as a message of `role`."""
    if not self.use_chat_template:
      return self.encode(text, add_bos=False)
    return self.encode(self.render_observation(text, role), add_bos=False)

  def render_observation(self, text: str, role: str = "tool") -> str:
    """The chat template's text between a policy turn's end-of-turn token and the next turn:
    rendered after an assistant message, with `text` as a `role` message and the generation
    prompt; the end-of-turn token itself is left out (the policy generated it)."""
    turn = self._TURN_SENTINEL
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": turn},
                {"role": role, "content": text}]
    full = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True,
                                              **self.chat_template_kwargs)
    if full.count(turn) != 1:
      raise ValueError(f"the chat template does not render an assistant turn followed by a "
                       f"{role!r} message as expected; set the environment's observation_role "
                       "to a role the template knows")
    tail = full[full.index(turn) + len(turn):]
    for stop in self.stop_ids:
      stop_text = self.tokenizer.convert_ids_to_tokens(int(stop))
      if stop_text and tail.startswith(stop_text):
        return tail[len(stop_text):]
    raise ValueError("the chat template does not end an assistant turn with a stop token "
                     f"({list(self.stop_ids)}): a policy turn could not end where the template "
                     "expects")

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` up to (excluding) the first stop id, special tokens skipped."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    stops = set(self.stop_ids)
    for j, i in enumerate(ids):
      if i in stops:
        ids = ids[:j]
        break
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  def save(self, out_dir: str) -> None:
    """Writes the tokenizer files (so that a model directory carries its tokenizer)."""
    self.tokenizer.save_pretrained(out_dir)


def has_chat_template(tokenizer: Any) -> bool:
  """Whether the HF tokenizer ships a chat template."""
  return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template_mode(mode: Union[str, bool], tokenizer: Any) -> bool:
  """`model.chat_template` -> whether prompts go through the tokenizer's chat template.

  `mode`: "auto" (on when the tokenizer ships a template: instruct and hybrid-thinking models such
  as Qwen3 and Llama-3.x-Instruct do; character tokenizers do not), "on" (an error when there is
  none), "off"; True / False mean "on" / "off".
  """
  if isinstance(mode, bool):
    mode = "on" if mode else "off"
  if mode not in CHAT_TEMPLATE_MODES:
    raise ValueError(f"model.chat_template={mode!r}: expected one of {CHAT_TEMPLATE_MODES} "
                     "(or a bool)")
  if mode == "auto":
    return has_chat_template(tokenizer)
  return mode == "on"


def _eos_field(path: str) -> list[int]:
  """The `eos_token_id` of a JSON file (an int, a list of ints, or absent) as a list."""
  try:
    with open(path, encoding="utf-8") as f:
      eos = json.load(f).get("eos_token_id")
  except FileNotFoundError:
    return []
  except (ValueError, AttributeError) as e:
    raise ValueError(f"{path}: cannot read eos_token_id ({e}); fix the JSON file") from e
  if eos is None:
    return []
  values = eos if isinstance(eos, list) else [eos]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise ValueError(f"{path}: eos_token_id={eos!r} must be an int or a list of ints")
  return [int(v) for v in values]


def model_eos_ids(model_dir: str) -> tuple[int, ...]:
  """Every end-of-sequence id a model directory declares: the union, in order, of `eos_token_id`
  (an int or a list) in its generation_config.json and config.json; () when neither sets one.

  E.g. Qwen3-8B: (151645, 151643) (<|im_end|>, <|endoftext|>); Llama-3.2-3B-Instruct:
  (128001, 128008, 128009) (<|end_of_text|>, <|eom_id|>, <|eot_id|>). Generation must stop at
  any of them: `load_tokenizer(extra_stop_ids=...)` adds them to the tokenizer's own eos.
  """
  ids = (_eos_field(os.path.join(model_dir, "generation_config.json")) +
         _eos_field(os.path.join(model_dir, "config.json")))
  return tuple(dict.fromkeys(ids))


def load_tokenizer(path: str, extra_stop_ids: Sequence[int] = (),
                   use_chat_template: Union[str, bool] = False,
                   chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> TextCodec:
  """A `TextCodec` over the HF tokenizer in directory `path` (e.g. a model directory).

  Its stop ids are the tokenizer's eos, `extra_stop_ids` and the eos ids that `path` itself
  declares (`model_eos_ids`: generation_config.json / config.json, when present).
  `use_chat_template`: a bool, or a `model.chat_template` mode ("auto", "on", "off").
  """
  # Imported here: jaxreplay.models imports jax, which importing jaxreplay.tasks must not.
  from jaxreplay.models import safetensors_io  # pylint: disable=g-import-not-at-top
  markers = safetensors_io.TOKENIZER_MARKERS
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
  if not any(os.path.isfile(os.path.join(path, f)) for f in markers):
    raise FileNotFoundError(
        f"{path!r} holds no tokenizer files (looked for {', '.join(markers)}); pass the "
        "directory of a Hugging Face model or one written by build_char_tokenizer(chars, out_dir)")
  tok = hf_tokenizer_from_dir(path)
  stops = tuple(int(i) for i in extra_stop_ids) + model_eos_ids(path)
  return TextCodec(tok, extra_stop_ids=stops,
                   use_chat_template=use_chat_template_mode(use_chat_template, tok),
                   chat_template_kwargs=chat_template_kwargs)


def check_tokenizer_matches_model(tokenizer: Any, model_cfg: Any) -> None:
  """Raises ValueError when the tokenizer cannot drive the model described by `model_cfg`.

  `tokenizer` is a TextCodec or an HF tokenizer; `model_cfg` a `ModelConfig`. Checks that every
  token id fits in the embedding table (tokenizer vocab <= model vocab_size; the model may be larger,
  as Qwen pads its table) and that the model's eos id, when set, is one of the codec's stop ids
  (any of them: a model may declare several, e.g. Llama-3.2-Instruct's <|end_of_text|> and
  <|eot_id|>, and `ModelConfig` keeps the first).
  """
  codec = tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer)
  if codec.vocab_size > model_cfg.vocab_size:
    raise ValueError(
        f"tokenizer/model mismatch: the tokenizer's ids go up to {codec.vocab_size - 1} but the "
        f"model's vocab_size is {model_cfg.vocab_size}; ids >= {model_cfg.vocab_size} have no "
        "embedding. "
        "Use the tokenizer saved with this model, or build the model with a larger vocab_size")
  eos = model_cfg.eos_token_id
  if eos is not None and int(eos) not in codec.stop_ids:
    raise ValueError(
        f"tokenizer/model mismatch: the model's eos_token_id={eos} but the tokenizer stops at "
        f"{list(codec.stop_ids)}; use the tokenizer saved with this model, add the model's eos "
        "ids to its generation_config.json (`eos_token_id`: an int or a list), or set "
        f"ModelConfig.eos_token_id={codec.eos_id}")
