r"""Talk to an exported model: `python -m jaxreplay.chat --model=WORKDIR/hf --prompt="47+38="`.

Loads a Hugging Face model directory (a run's WORKDIR/hf export, or any model jaxreplay trains:
`models.config.ARCHITECTURES`), optionally a PEFT LoRA adapter merged over it
(`--adapter=WORKDIR/hf_adapter --model=BASE`), and answers each prompt: those of `--prompt`
(repeatable), else one per line of standard input (a `> ` prompt when it is a terminal). Prompts go
through the model's chat template when its tokenizer ships one (`--chat_template=auto`, as
`model.chat_template` of a run: tasks.tokenizer.TextCodec); generation stops at the model's eos
ids. Sampling: `--temperature` (0 = greedy, the default), `--top_p`, `--top_k`, `--max_tokens`,
`--num_samples` answers per prompt, `--seed`. It samples with the JAX sampler of the rollouts
(`rollout.jax_sampler.JaxSampler`) on the default JAX device.

Exit status: 0; 2 for a bad command line or a model / adapter directory that cannot be read (one
line, `error: <what>; <the fix>`).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence, TextIO

from absl import app
from absl import flags

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory, e.g. a run's WORKDIR/hf "
                             "(with --adapter: the adapter's base model).")
_ADAPTER = flags.DEFINE_string("adapter", None, "PEFT LoRA adapter directory (a run's "
                               "WORKDIR/hf_adapter), merged over --model.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable); none: one prompt per "
                                    "line of standard input.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1 = off.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = off.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Most tokens of an answer.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Answers per prompt.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CHAT_TEMPLATE = flags.DEFINE_enum("chat_template", "auto", ["auto", "on", "off"],
                                   "Prompts as a user turn of the tokenizer's chat template: auto "
                                   "(when it ships one), on, off.")
_TEMPLATE_KWARGS = flags.DEFINE_string("chat_template_kwargs", "", "JSON object of template "
                                       "variables, e.g. '{\"enable_thinking\": false}'.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer directory; default: --model's.")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Most tokens of prompt + answer; 0 = the model's "
                                "max_position_embeddings (at most 4096).")


class ChatError(ValueError):
  """A model, adapter or option that cannot be used (one line with its fix)."""


def load_params(model: str, adapter: Optional[str] = None):
  """(ModelConfig, params) of an HF model directory in float32, with a PEFT adapter merged in."""
  from jaxreplay.models import hf_io  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import lora  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(os.path.join(model, "config.json")):
    raise ChatError(f"--model={model} is not a Hugging Face model directory (no config.json); give "
                    "a run's WORKDIR/hf, or with --adapter the adapter's base model")
  cfg, params = hf_io.load_hf(model)
  if adapter:
    if not os.path.isfile(os.path.join(adapter, lora.ADAPTER_CONFIG)):
      raise ChatError(f"--adapter={adapter} holds no {lora.ADAPTER_CONFIG}; give a run's "
                      "WORKDIR/hf_adapter (a PEFT LoRA directory)")
    spec, adapters = lora.load_peft(adapter, cfg)
    params = lora.merge(cfg, params, adapters, spec)
  return cfg, params


class Chat:
  """A model and its tokenizer, answering prompts (`answer`).

  Args:
    model: HF model directory; adapter: a PEFT adapter directory merged over it, or None.
    tokenizer: tokenizer directory (default `model`).
    chat_template: "auto" | "on" | "off" (`tasks.tokenizer.load_tokenizer`); template_kwargs:
      the template's variables.
    max_len: prompt + answer tokens a row holds (0: max_position_embeddings, at most 4096).
    seed: the sampler's seed.
  """

  def __init__(self, model: str, adapter: Optional[str] = None, tokenizer: Optional[str] = None,
               chat_template: str = "auto", template_kwargs: Optional[dict] = None,
               max_len: int = 0, seed: int = 0):
    from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
    from jaxreplay.tasks import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    cfg, params = load_params(model, adapter)
    try:
      self.codec = tokenizer_lib.load_tokenizer(tokenizer or model, use_chat_template=chat_template,
                                                chat_template_kwargs=template_kwargs)
    except (FileNotFoundError, ValueError) as e:
      raise ChatError(f"{e}; pass --tokenizer=DIR") from None
    self.max_len = int(max_len or min(cfg.max_position_embeddings, 4096))
    self._sampler = JaxSampler(cfg, params, self.max_len, batch_size=1,
                               eos_token_ids=self.codec.stop_ids, seed=seed)

  def answer(self, prompt: str, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, max_tokens: int = 128) -> list[str]:
    """`n` answers to `prompt` (text up to the first stop token)."""
    from jaxreplay.rollout.base import SamplingParams  # pylint: disable=g-import-not-at-top
    ids = self.codec.encode_prompt(prompt)
    room = self.max_len - len(ids)
    if room < 1:
      raise ChatError(f"the prompt has {len(ids)} tokens and --max_len={self.max_len} leaves no "
                      "room for an answer; raise --max_len or shorten the prompt")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                              max_tokens=min(max_tokens, room))
    group = self._sampler.generate([ids], n, sampling)[0]
    return [self.codec.decode(c.tokens) for c in group.completions]


def prompts_from(stream: TextIO, interactive: bool) -> Sequence[str]:
  """Prompts of a text stream, one per non-empty line (printing "> " before each on a terminal)."""
  while True:
    if interactive:
      print("> ", end="", flush=True)
    line = stream.readline()
    if not line:
      return
    if line.strip():
      yield line.rstrip("\n")


def fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def main(argv):
  from jaxreplay.config import devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import host_devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.infra import console_log  # pylint: disable=g-import-not-at-top
  # before JAX starts: on a machine without a GPU, no TPU / CUDA probe and none of its log lines
  host_devices.cpu_environment(gpus_visible=bool(devices.visible_gpus()))
  console_log.setup()
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; give prompts with --prompt=TEXT or on standard input")
  if not _MODEL.value:
    fail("--model is missing; give a model directory, e.g. --model=runs/tiny/hf")
  try:
    kwargs = json.loads(_TEMPLATE_KWARGS.value) if _TEMPLATE_KWARGS.value else None
  except ValueError as e:
    fail(f"--chat_template_kwargs={_TEMPLATE_KWARGS.value!r} is not JSON ({e}); e.g. "
         "'{\"enable_thinking\": false}'")
  settings = dict(n=_NUM_SAMPLES.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                  top_k=_TOP_K.value, max_tokens=_MAX_TOKENS.value)
  try:
    from jaxreplay.rollout.base import SamplingParams  # pylint: disable=g-import-not-at-top
    SamplingParams(**{k: v for k, v in settings.items() if k != "n"})
    if _NUM_SAMPLES.value < 1:
      raise ValueError(f"--num_samples={_NUM_SAMPLES.value} must be >= 1")
    chat = Chat(_MODEL.value, _ADAPTER.value, _TOKENIZER.value, _CHAT_TEMPLATE.value, kwargs,
                _MAX_LEN.value, _SEED.value)
    prompts = _PROMPT.value or prompts_from(sys.stdin, sys.stdin.isatty())
    for prompt in prompts:
      answers = chat.answer(prompt, **settings)
      for i, text in enumerate(answers):
        print(text if len(answers) == 1 else f"[{i + 1}] {text}", flush=True)
  except (ChatError, ValueError, FileNotFoundError) as e:
    fail(str(e).replace("\n", " "))


if __name__ == "__main__":
  app.run(main)
