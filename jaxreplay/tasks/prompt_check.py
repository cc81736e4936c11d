"""Every prompt of a task checked against the context once, when the run is built.

A prompt fits when its tokens plus the completion budget fit the samplers' context:
`Lp + max_tokens <= max_len` (`model.max_len`, `rollout.max_tokens`; the contract of
`jaxreplay.rollout.base.check_prompts`, which every `generate` call enforces). A prompt that does
not fit would crash the run when first sampled, and, since a resumed run hands its pending prompts
out first, again on every resume. So nothing is left to sampling:

- a dataset task (`MathTask`: `train` / `heldout` lists with `train_sources` / `heldout_sources`):
  every row is tokenized; rows that are too long or cannot be tokenized are dropped with one
  WARNING naming a few of them ("file.jsonl:LINE") and the count, as long as the dropped share of
  the split is at most `max_skip_fraction`; above it (or when nothing is left) `PromptCheckError`
  names the count, examples and the fix. The counts are set on the task as `skipped_rows` /
  `skipped_eval_rows` (the run's metrics `data/skipped_rows`, `data/skipped_eval_rows`).
- a procedural task (`ArithmeticTask`, `ScratchpadAdditionTask`): its longest possible prompts
  (`longest_prompts()`) must fit, else `PromptCheckError` (no row to drop: the config is wrong).
- any other task: `fallback_samples` sampled prompts and its eval set must fit (the old check).

Tokenizing is batched (a fast HF tokenizer: ~10k prompts/s on one core; see `check_task_prompts`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from absl import logging
import numpy as np

MAX_EXAMPLES = 5      # rows named in a warning or an error
_CHUNK = 1024         # prompts per batched tokenizer call


class PromptCheckError(ValueError):
  """Prompts that do not fit the context: too many dataset rows, or a procedural task's longest."""


@dataclasses.dataclass(frozen=True)
class BadRow:
  """A prompt that cannot be used: `index` into the checked list, `source` (e.g.
  "train.jsonl:17"), `tokens` (its length; None when it could not be tokenized), `reason`."""
  index: int
  source: str
  tokens: Optional[int]
  reason: str


def _encode_len(codec, text: str) -> int:
  return int(np.asarray(codec.encode_prompt(text)).size)


def _batched_lengths(codec, texts: Sequence[str]) -> Optional[list[int]]:
  """Token counts of `codec.encode_prompt(t)` from one batched tokenizer call, or None when the
  codec is not a `TextCodec` or the batch raised (the caller then encodes one at a time)."""
  tok = getattr(codec, "tokenizer", None)
  if tok is None or not hasattr(codec, "use_chat_template"):
    return None
  try:
    if codec.use_chat_template:
      rendered = [codec.render_chat(t) for t in texts]  # the template and its kwargs
      extra = 0  # encode_prompt adds no bos after a chat template
    else:
      rendered = list(texts)
      extra = 0 if codec.bos_id is None else 1
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
  except Exception:  # pylint: disable=broad-except
    return None
  return [len(x) + extra for x in ids]


def prompt_lengths(codec, texts: Sequence[str]) -> list[Any]:
  """For each text, its token count under `codec.encode_prompt` (an int), or the exception that
  tokenizing it raised. Batched when `codec` is a `TextCodec` (checked against a one-at-a-time
  encoding of the first text of each chunk)."""
  out: list[Any] = []
  for start in range(0, len(texts), _CHUNK):
    chunk = list(texts[start:start + _CHUNK])
    lengths = _batched_lengths(codec, chunk)
    if lengths is not None:
      try:
        if _encode_len(codec, chunk[0]) != lengths[0]:
          lengths = None  # the batched path does not match encode_prompt: do not trust it
      except Exception:  # pylint: disable=broad-except
        lengths = None
    if lengths is None:
      lengths = []
      for text in chunk:
        try:
          lengths.append(_encode_len(codec, text))
        except Exception as e:  # pylint: disable=broad-except
          lengths.append(e)
    out.extend(lengths)
  return out


def find_bad_prompts(codec, texts: Sequence[str], max_prompt_tokens: int,
                     sources: Optional[Sequence[str]] = None) -> list[BadRow]:
  """The texts whose prompt has more than `max_prompt_tokens` tokens, no tokens, or cannot be
  tokenized, in order. `sources` name the rows in messages (default "row i", 1-based)."""
  bad = []
  for i, n in enumerate(prompt_lengths(codec, texts)):
    source = sources[i] if sources is not None else f"row {i + 1}"
    if isinstance(n, Exception):
      bad.append(BadRow(i, source, None, f"cannot be tokenized: {type(n).__name__}: "
                                         f"{str(n)[:120]}"))
    elif n == 0:
      bad.append(BadRow(i, source, 0, "tokenizes to no tokens"))
    elif n > max_prompt_tokens:
      bad.append(BadRow(i, source, n, f"{n} tokens"))
  return bad


def _examples(bad: Sequence[BadRow]) -> str:
  shown = ", ".join(f"{b.source} ({b.reason})" for b in bad[:MAX_EXAMPLES])
  return shown + (f", ... ({len(bad) - MAX_EXAMPLES} more)" if len(bad) > MAX_EXAMPLES else "")


@dataclasses.dataclass(frozen=True)
class Context:
  """The context a prompt must fit, and how the config names it (for messages)."""
  max_len: int
  max_tokens: int
  max_len_name: str = "model.max_len"
  max_tokens_name: str = "rollout.max_tokens"

  @property
  def max_prompt_tokens(self) -> int:
    """Longest prompt that fits [tokens]: max_len - max_tokens."""
    return self.max_len - self.max_tokens

  def describe(self) -> str:
    return (f"prompt tokens + {self.max_tokens_name}={self.max_tokens} must be <= "
            f"{self.max_len_name}={self.max_len}, i.e. at most {self.max_prompt_tokens} prompt "
            "tokens")


def filter_rows(items: Sequence[Any], texts: Sequence[str], sources: Sequence[str], codec,
                context: Context, max_skip_fraction: float, what: str,
                skip_key: str = "task.max_skip_fraction") -> tuple[list[Any], list[str], int]:
  """(kept items, their sources, number dropped): `items` whose prompt `texts` fit `context`.

  Drops the rest with one WARNING naming up to MAX_EXAMPLES of them and the count, when the
  dropped share is <= `max_skip_fraction`; otherwise, or when nothing would be left, raises
  PromptCheckError naming the count, examples and the fix. `what` names the rows ("training").
  """
  if not 0.0 <= max_skip_fraction <= 1.0:
    raise ValueError(f"max_skip_fraction={max_skip_fraction} must be in [0, 1]")
  bad = find_bad_prompts(codec, texts, context.max_prompt_tokens, sources)
  if not bad:
    return list(items), list(sources), 0
  n, total = len(bad), len(items)
  longest = max((b.tokens or 0) for b in bad)
  share = n / total
  if share > max_skip_fraction or n == total:
    fixes = []
    if longest > context.max_prompt_tokens:
      fixes.append(f"raise {context.max_len_name} (to >= {longest + context.max_tokens} for the "
                   f"longest, {longest} tokens) or lower {context.max_tokens_name}")
    fixes += ["filter those rows out of the dataset",
              f"or raise {skip_key} (now {max_skip_fraction:g}) to drop them"]
    raise PromptCheckError(
        f"{n} of {total} {what} rows ({share:.2%}, more than {skip_key}={max_skip_fraction:g}) "
        f"have a prompt that does not fit the context ({context.describe()}) or cannot be "
        f"tokenized: {_examples(bad)}. Fix: {'; '.join(fixes)}")
  logging.warning("dropped %d of %d %s rows (%.2f%%, <= %s=%g) whose prompt does not fit the "
                  "context (%s) or cannot be tokenized: %s", n, total, what, 100 * share, skip_key,
                  max_skip_fraction, context.describe(), _examples(bad))
  drop = {b.index for b in bad}
  kept = [x for i, x in enumerate(items) if i not in drop]
  kept_sources = [s for i, s in enumerate(sources) if i not in drop]
  return kept, kept_sources, n


def check_task_prompts(task, codec, context: Context, max_skip_fraction: float = 0.01, *,
                       seed: int = 0, fallback_samples: int = 64) -> dict[str, int]:
  """Checks every prompt `task` can produce against `context` (module docstring); a dataset
  task's unusable rows are dropped from `task.train` / `task.heldout` (and their sources).

  Sets `task.skipped_rows`, `task.skipped_eval_rows` and returns them as
  {"data/skipped_rows": n, "data/skipped_eval_rows": m}. Raises PromptCheckError (a ValueError)
  naming the rows and the fix. Cost: one tokenization of every row; 10k short rows take about a
  second with a fast HF tokenizer on one core (tests/tasks/test_prompt_check.py measures it).
  """
  skipped = {"data/skipped_rows": 0, "data/skipped_eval_rows": 0}
  if hasattr(task, "train") and hasattr(task, "heldout"):
    for split, key, what in (("train", "data/skipped_rows", "training"),
                             ("heldout", "data/skipped_eval_rows", "held-out")):
      problems = getattr(task, split)
      sources = getattr(task, f"{split}_sources", None) or [
          f"{what} row {i}" for i in range(1, len(problems) + 1)]
      kept, kept_sources, n = filter_rows(problems, [p.prompt for p in problems], sources, codec,
                                          context, max_skip_fraction, what)
      if n:
        setattr(task, split, kept)
        if hasattr(task, f"{split}_sources"):
          setattr(task, f"{split}_sources", kept_sources)
      skipped[key] = n
  elif hasattr(task, "longest_prompts"):
    prompts = list(task.longest_prompts())
    bad = find_bad_prompts(codec, prompts, context.max_prompt_tokens,
                           [f"longest prompt {p!r}" for p in prompts])
    if bad:
      longest = max((b.tokens or 0) for b in bad)
      digits = getattr(task, "num_digits", None)
      raise PromptCheckError(
          f"the task's longest prompts do not fit the context ({context.describe()}): "
          f"{_examples(bad)}. Fix: raise {context.max_len_name} to >= "
          f"{longest + context.max_tokens}, lower {context.max_tokens_name}"
          + (f", or lower task.num_digits (now {digits})" if digits is not None else ""))
  else:
    problems = list(task.sample(np.random.default_rng(seed), fallback_samples))
    bad = find_bad_prompts(codec, [p.prompt for p in problems], context.max_prompt_tokens)
    if bad:
      raise PromptCheckError(
          f"{len(bad)} of {fallback_samples} sampled training prompts do not fit the context "
          f"({context.describe()}): {_examples(bad)}. Fix: raise {context.max_len_name} or "
          "filter long prompts")
  task.skipped_rows = skipped["data/skipped_rows"]
  task.skipped_eval_rows = skipped["data/skipped_eval_rows"]
  return skipped

