"""Math datasets from local files (JSONL, JSON, parquet) and `MathTask` with a math-verify reward.

Typical sources: OpenR1-Math-220k (`problem`, `answer`), MATH / MATH-500 (`problem`, `answer`, or
`solution` whose \\boxed{} holds the answer). Nothing is downloaded: point `path` at files on disk.
"""
from __future__ import annotations

import glob
import io
import json
import os
from typing import Callable, Optional, Sequence, Union

import numpy as np

from jaxreplay.tasks import rewards as rewards_lib
from jaxreplay.tasks.arithmetic import Problem, is_heldout, problem_id

PROMPT_TEMPLATES = {
    "plain": "{problem}",
    "qwen_math": ("{problem}\nPlease reason step by step, and put your final answer within "
                  "\\boxed{{}}."),
    "r1": ("Solve the following math problem. Think step by step, then give the final answer "
           "within \\boxed{{}}.\n\nProblem: {problem}\n\nSolution:"),
}
_SUFFIXES = (".jsonl", ".json", ".parquet")


def _files(path: str) -> list[str]:
  if os.path.isdir(path):
    found = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if f.endswith(_SUFFIXES))
    if not found:
      raise FileNotFoundError(f"{path!r} is a directory without {'/'.join(_SUFFIXES)} files")
    return found
  if not os.path.isfile(path):
    raise FileNotFoundError(f"math dataset {path!r} not found: give a local .jsonl, .json or "
                            ".parquet file (or a directory of them); nothing is downloaded")
  if not path.endswith(_SUFFIXES):
    raise ValueError(f"{path!r}: unsupported file type; expected one of {_SUFFIXES}")
  return [path]


_FIX_ENCODING = ("the dataset must be UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8 "
                 "IN > OUT` when it is Latin-1) or remove that row")


def _utf8(raw: bytes, path: str, lineno: int, offset: int) -> str:
  """`raw` (line `lineno` of `path`, starting at byte `offset` of the file) decoded as UTF-8; a
  UTF-8 byte-order mark at the start of the file is dropped. Raises ValueError naming
  file:line, the byte offset and the fix."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    bad = raw[e.start:e.start + 4]
    raise ValueError(f"{path}:{lineno}: not UTF-8 at byte offset {offset + e.start} of the file "
                     f"(byte {e.start + 1} of the line: {e.reason}, bytes {bad!r}); "
                     f"{_FIX_ENCODING}") from None
  return text[1:] if offset == 0 and text.startswith("\ufeff") else text


def _read_rows(path: str) -> list[tuple[str, dict]]:
  """(source, row) pairs of one file; source names where the row is: "path:LINE" in a JSONL file
  (1-based line), "path:row N" in a JSON list or a parquet file (1-based row)."""
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(f"reading {path!r} needs pyarrow, a dependency of jaxreplay: `pip install "
                        "pyarrow` (or reinstall jaxreplay), or convert the file to JSONL") from e
    try:
      table = pq.read_table(path)
    except Exception as e:  # pylint: disable=broad-except  (pyarrow's ArrowInvalid, OSError, ...)
      raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e}); check "
                       "that the download finished, or convert the file to JSONL") from e
    return [(f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]
  if path.endswith(".json"):
    with open(path, "rb") as f:
      raw = f.read()
    try:
      text = _utf8(raw, path, 1, 0)
    except ValueError:
      # Name the line of the first bad byte: decode line by line up to it.
      offset = 0
      for lineno, line in enumerate(io.BytesIO(raw), 1):
        _utf8(line, path, lineno, offset)
        offset += len(line)
      raise
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, list):
      raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    return [(f"{path}:row {i}", row) for i, row in enumerate(data, 1)]
  rows = []
  offset = 0
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      line = _utf8(raw, path, lineno, offset)
      offset += len(raw)
      if not line.strip():
        continue
      try:
        rows.append((f"{path}:{lineno}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
  return rows


def load_math_records(path: str, problem_key: str = "problem", answer_key: str = "answer",
                      template: str = "qwen_math", max_examples: Optional[int] = None
                      ) -> tuple[list[Problem], list[str]]:
  """(problems, sources): `load_math_dataset`'s problems and, for each, where its row is in the
  files ("file.jsonl:LINE", or "file.parquet:row N"; see `_read_rows`), for messages that name
  the row (`jaxreplay.tasks.prompt_check`)."""
  fmt = PROMPT_TEMPLATES.get(template, template)
  if "{problem}" not in fmt:
    raise ValueError(f"template={template!r} is neither one of {sorted(PROMPT_TEMPLATES)} nor a "
                     "format string containing '{problem}'")
  problems: list[Problem] = []
  sources: list[str] = []
  for file in _files(path):
    for source, row in _read_rows(file):
      if not isinstance(row, dict):
        raise ValueError(f"{source}: the row is a {type(row).__name__}, expected an object")
      for key in (problem_key, answer_key):
        if key not in row:
          raise ValueError(f"{source}: the row has no field {key!r}; fields found: {sorted(row)}. "
                           "Set problem_key / answer_key to the dataset's field names")
      text, answer = row[problem_key], row[answer_key]
      if text is None or answer is None or not str(text).strip() or not str(answer).strip():
        continue
      prompt = fmt.format(problem=str(text))
      problems.append(Problem(prompt=prompt, answer=str(answer).strip(), id=problem_id(prompt)))
      sources.append(source)
      if max_examples is not None and len(problems) >= max_examples:
        return problems, sources
  if not problems:
    raise ValueError(f"{path!r}: no usable rows (all problems or answers empty)")
  return problems, sources


def load_math_dataset(path: str, problem_key: str = "problem", answer_key: str = "answer",
                      template: str = "qwen_math",
                      max_examples: Optional[int] = None) -> list[Problem]:
  """Problems from `path` (a file, or a directory whose .jsonl/.json/.parquet files are read in
  sorted order). `prompt` = PROMPT_TEMPLATES[template] (or a custom string with "{problem}")
  applied to the `problem_key` field; `answer` = the `answer_key` field as a string.
  Rows with an empty problem or answer are skipped. Files must be UTF-8 (an error names
  file:line and the byte offset otherwise).
  """
  return load_math_records(path, problem_key, answer_key, template, max_examples)[0]


def split_heldout(problems: Sequence[Problem], heldout_fraction: float = 0.05,
                  seed: int = 0) -> tuple[list[Problem], list[Problem]]:
  """(train, held-out): a problem is held out when a hash of its prompt falls under the fraction,
  so the split does not depend on file order and is the same in every run."""
  if not 0.0 < heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1)")
  train, heldout = [], []
  for p in problems:
    (heldout if is_heldout(p.prompt, heldout_fraction, seed) else train).append(p)
  if not train or not heldout:
    raise ValueError(f"split_heldout: {len(train)} train / {len(heldout)} held-out problems from "
                     f"{len(problems)}; use more data or another heldout_fraction")
  return train, heldout


def _sources(sources: Optional[Sequence[str]], n: int, what: str) -> list[str]:
  if sources is None:
    return [f"{what} row {i}" for i in range(1, n + 1)]
  if len(sources) != n:
    raise ValueError(f"MathTask: {len(sources)} {what} sources for {n} {what} problems")
  return list(sources)


WARMUP_ARGS = ("\\boxed{1}", "1")  # (completion, answer) of the reward's warm-up call


class MathTask(rewards_lib.SafeScoring):
  """A math dataset task: uniform sampling of training problems, a fixed eval set, math-verify reward.

  Args:
    train: training problems.
    heldout: evaluation problems (disjoint from `train`).
    reward_timeout_s: time limit of one reward call [s].
    num_reward_workers: reward child processes (`score_batch` spreads a batch over them, and
      concurrent `score_batch` calls share them).
    reward_memory_gib: address space one reward call may add to its child process [GiB]
      (`SafeReward.memory_limit_gib`; None: no limit).
    reward_fn: None (math-verify), a "module:function" plug-in, or a module-level function;
      called as fn(completion: str, answer: str) -> float in the reward processes, with the
      same time and memory limits. A plug-in is imported here and in each reward process, and
      called once on ("\\boxed{1}", "1") before the task is returned: an import error, a wrong
      signature, an exception or a non-number raises ValueError then, not mid-run.
    train_sources, heldout_sources: where each problem's row is ("file.jsonl:LINE"), for messages;
      default "train row i" / "held-out row i".

  Attributes `train_sources` / `heldout_sources` follow `train` / `heldout`; `skipped_rows` /
  `skipped_eval_rows` count the rows `prompt_check.check_task_prompts` dropped (0 until then).
  Same interface as `ArithmeticTask`.
  """

  skipped_rows = 0
  skipped_eval_rows = 0

  def __init__(self, train: Sequence[Problem], heldout: Sequence[Problem],
               reward_timeout_s: float = 5.0, num_reward_workers: int = 1,
               reward_memory_gib: Optional[float] = 2.0,
               train_sources: Optional[Sequence[str]] = None,
               heldout_sources: Optional[Sequence[str]] = None,
               reward_fn: Union[None, str, Callable[[str, str], float]] = None):
    if not train:
      raise ValueError("MathTask: no training problems")
    if not heldout:
      raise ValueError("MathTask: no held-out problems")
    self.train, self.heldout = list(train), list(heldout)
    self.train_sources = _sources(train_sources, len(self.train), "train")
    self.heldout_sources = _sources(heldout_sources, len(self.heldout), "held-out")
    fn = rewards_lib.math_verify_reward if reward_fn is None else reward_fn
    if isinstance(fn, str):
      rewards_lib.import_reward_fn(fn)  # fail here, naming the fix, not in a reward process
      fn = rewards_lib.PluginReward(fn)
    self._safe = rewards_lib.SafeReward(
        fn, timeout_s=reward_timeout_s, backend="process", num_workers=num_reward_workers,
        warmup_args=WARMUP_ARGS, memory_limit_gib=reward_memory_gib)
    if reward_fn is not None:
      self._check_reward(reward_fn)

  def _check_reward(self, reward_fn) -> None:
    """One uncounted call of a plug-in reward in a reward process; ValueError unless it returns a
    finite number."""
    status, value = self._safe.try_call(*WARMUP_ARGS)
    if status == "ok":
      return
    self._safe.close()
    detail = {"timeout": f"took over reward_timeout_s={self._safe.timeout_s} s",
              "memory": "ran over reward_memory_gib"}.get(status, f"failed: {value}")
    raise ValueError(f"reward_fn={reward_fn!r}: its warm-up call fn{WARMUP_ARGS!r} in a reward "
                     f"process {detail}. It must take (completion: str, answer: str), return a "
                     "finite float, and import in a fresh interpreter (the module must be on "
                     "PYTHONPATH)")

  @classmethod
  def from_files(cls, path: str, eval_path: Optional[str] = None, problem_key: str = "problem",
                 answer_key: str = "answer", template: str = "qwen_math",
                 heldout_fraction: float = 0.05, seed: int = 0,
                 max_examples: Optional[int] = None, **kwargs) -> "MathTask":
    """Training data from `path`; the held-out set from `eval_path` (e.g. MATH-500), or a hashed
    `heldout_fraction` of `path` when `eval_path` is None."""
    problems, sources = load_math_records(path, problem_key, answer_key, template, max_examples)
    source_of = {id(p): src for p, src in zip(problems, sources)}
    if eval_path is None:
      train, heldout = split_heldout(problems, heldout_fraction, seed)
      heldout_sources = [source_of[id(p)] for p in heldout]
    else:
      heldout, heldout_sources = load_math_records(eval_path, problem_key, answer_key, template)
      held = {p.prompt for p in heldout}
      train = [p for p in problems if p.prompt not in held]  # keep the eval set unseen
      if not train:
        raise ValueError(f"every problem of {path!r} is also in {eval_path!r}")
    return cls(train, heldout, train_sources=[source_of[id(p)] for p in train],
               heldout_sources=heldout_sources, **kwargs)

  @property
  def charset(self) -> str:
    """Every character of the prompts and answers (for a character-level tokenizer)."""
    chars = set()
    for p in self.train + self.heldout:
      chars.update(p.prompt)
      chars.update(p.answer)
    return "".join(sorted(chars | set(" \n")))

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` training problems drawn uniformly with replacement using `rng`."""
    return [self.train[int(i)] for i in rng.integers(len(self.train), size=n)]

  def eval_set(self, n: Optional[int] = None) -> list[Problem]:
    """The first `n` held-out problems (all when None)."""
    if n is not None and n > len(self.heldout):
      raise ValueError(f"eval_set({n}): only {len(self.heldout)} held-out problems")
    return self.heldout[:n] if n is not None else list(self.heldout)

  def sft_examples(self, n: int, seed: int = 0):
    """`n` (prompt, answer) training pairs, as `ArithmeticTask.sft_examples`."""
    rng = np.random.default_rng([seed, 0x5F7])
    for p in self.sample(rng, n):
      yield p.prompt, p.answer

  def reward(self, completion: str, problem: Problem) -> float:
    """Time-limited math-verify reward of one completion (0.0 on error or timeout)."""
    return self._safe(completion, problem.answer)
