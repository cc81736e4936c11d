"""Tokenizers: a character-level HF tokenizer for the procedural tasks, and `TextCodec`.

`TextCodec` is the one text <-> token-id interface the pipeline uses for every task: it wraps any
Hugging Face tokenizer directory (a real model's, or one written by `build_char_tokenizer`).
`transformers` (and `jaxreplay.models`, for the one list of tokenizer file names) are imported on
first use only, so that importing `jaxreplay.tasks` stays cheap (reward worker processes import this
package).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3 in a char tokenizer
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_char_tokenizer(chars: Sequence[str], out_dir: Optional[str] = None):
  """A `transformers.PreTrainedTokenizerFast` with one token per character.

  Ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then `chars` in order (duplicates dropped). Encoding with
  special tokens prepends <bos>; decoding fuses characters back, so any text over `chars` round-trips
  exactly (spaces and newlines included). Characters outside `chars` encode to <unk>.
  When `out_dir` is given the tokenizer is saved there (`AutoTokenizer.from_pretrained` loads it).
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

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
    vocab_size: number of ids the tokenizer can emit (base vocab + added tokens).
    eos_id: the end-of-sequence id (generation stops there).
    stop_ids: all ids that end a completion (eos plus `extra_stop_ids`), a tuple for SamplingParams.
    pad_id: padding id (falls back to eos_id when the tokenizer has no pad token, as Qwen's).
    bos_id: prepended by `encode` when not None (Qwen tokenizers have none).
    use_chat_template: `encode_prompt` wraps text as a user turn of the tokenizer's chat template.
  """

  def __init__(self, tokenizer: Any, extra_stop_ids: Sequence[int] = (),
               use_chat_template: bool = False):
    self.tokenizer = tokenizer
    eos = tokenizer.eos_token_id
    if eos is None:
      raise ValueError("tokenizer has no eos token: set `eos_token` in its tokenizer_config.json "
                       "(generation needs a stop token)")
    self.eos_id = int(eos)
    self.stop_ids = tuple(dict.fromkeys([self.eos_id] + [int(i) for i in extra_stop_ids]))
    self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
    self.vocab_size = int(len(tokenizer))
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
      raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
    self.use_chat_template = use_chat_template

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
    rendered = self.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return self.encode(rendered, add_bos=False)

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


def load_tokenizer(path: str, extra_stop_ids: Sequence[int] = (),
                   use_chat_template: bool = False) -> TextCodec:
  """A `TextCodec` over the HF tokenizer in directory `path` (e.g. a model directory)."""
  # Imported here: jaxreplay.models imports jax, which importing jaxreplay.tasks must not.
  from jaxreplay.models import safetensors_io  # pylint: disable=g-import-not-at-top
  markers = safetensors_io.TOKENIZER_MARKERS
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
  if not any(os.path.isfile(os.path.join(path, f)) for f in markers):
    raise FileNotFoundError(
        f"{path!r} holds no tokenizer files (looked for {', '.join(markers)}); pass the "
        "directory of a Hugging Face model or one written by build_char_tokenizer(chars, out_dir)")
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(path)
  return TextCodec(tok, extra_stop_ids=extra_stop_ids, use_chat_template=use_chat_template)


def check_tokenizer_matches_model(tokenizer: Any, model_cfg: Any) -> None:
  """Raises ValueError when the tokenizer cannot drive the model described by `model_cfg`.

  `tokenizer` is a TextCodec or an HF tokenizer; `model_cfg` a `ModelConfig`. Checks that every
  token id fits in the embedding table (tokenizer vocab <= model vocab_size; the model may be larger,
  as Qwen pads its table) and that the model's eos id, when set, is one of the tokenizer's stop ids.
  """
  codec = tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer)
  if codec.vocab_size > model_cfg.vocab_size:
    raise ValueError(
        f"tokenizer/model mismatch: the tokenizer has {codec.vocab_size} tokens but the model's "
        f"vocab_size is {model_cfg.vocab_size}; ids >= {model_cfg.vocab_size} have no embedding. "
        "Use the tokenizer saved with this model, or build the model with a larger vocab_size")
  eos = model_cfg.eos_token_id
  if eos is not None and int(eos) not in codec.stop_ids:
    raise ValueError(
        f"tokenizer/model mismatch: the model's eos_token_id={eos} but the tokenizer stops at "
        f"{list(codec.stop_ids)}; set ModelConfig.eos_token_id={codec.eos_id} or pass the model's "
        "eos as an extra stop id")
