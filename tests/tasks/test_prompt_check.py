"""Every prompt checked against the context when the task is built: over-long dataset rows are
dropped with a warning naming file:line (up to `max_skip_fraction`, else an error), a procedural
task's longest prompt must fit, and the counts reach the metrics row."""
import json
import logging
import time

import numpy as np
import pytest

from jaxreplay.data.experience import PromptSource
from jaxreplay.tasks import arithmetic, math_data, prompt_check, scratchpad
from jaxreplay.tasks import tokenizer as tok_lib
from tests.helpers.deps import require

require("transformers")

CONTEXT = prompt_check.Context(max_len=60, max_tokens=10)  # at most 50 prompt tokens
LONG = "What is " + "1 + " * 60 + "1?"  # 250 characters: 251 tokens with the character tokenizer


def _problem(i):
  return {"problem": f"What is {i} + {i}?", "answer": str(2 * i)}


def _write_jsonl(path, rows):
  """Writes `rows` one per line, a blank line after every 10th (so line != row index + 1)."""
  with open(path, "w", encoding="utf-8") as f:
    for i, r in enumerate(rows):
      f.write(json.dumps(r) + "\n")
      if i % 10 == 9:
        f.write("\n")


def _line_of(path, text):
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if line.strip() and json.loads(line)["problem"] == text:
        return lineno
  raise AssertionError(text)


@pytest.fixture(scope="module")
def codec():
  chars = "".join(sorted(set("What is 0123456789+?\n") | set(LONG)))
  return tok_lib.TextCodec(tok_lib.build_char_tokenizer(chars))


def _math_task(tmp_path, train_rows, eval_rows):
  _write_jsonl(tmp_path / "train.jsonl", train_rows)
  _write_jsonl(tmp_path / "eval.jsonl", eval_rows)
  return math_data.MathTask.from_files(str(tmp_path / "train.jsonl"),
                                       eval_path=str(tmp_path / "eval.jsonl"), template="plain")


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_over_long_row_is_dropped_with_its_file_line_and_counted(tmp_path, codec, caplog):
  rows = [_problem(i) for i in range(200)]
  rows[123] = {"problem": LONG, "answer": "61"}
  task = _math_task(tmp_path, rows, [_problem(i) for i in range(1000, 1020)])
  line = _line_of(tmp_path / "train.jsonl", LONG)
  assert line == 136  # row 123 after 12 blank lines
  assert task.train_sources[123] == f"{tmp_path / 'train.jsonl'}:{line}"
  caplog.set_level(logging.INFO)
  out = prompt_check.check_task_prompts(task, codec, CONTEXT, max_skip_fraction=0.01)
  assert out == {"data/skipped_rows": 1, "data/skipped_eval_rows": 0}
  assert (task.skipped_rows, task.skipped_eval_rows) == (1, 0)
  assert len(task.train) == len(task.train_sources) == 199
  assert LONG not in {p.prompt for p in task.train}
  assert f"train.jsonl:{line}" not in " ".join(task.train_sources)
  assert task.train_sources[123].endswith(f"train.jsonl:{line + 1}")  # the next row moved up
  (warning,) = _warnings(caplog)
  assert f"train.jsonl:{line} (251 tokens)" in warning and "dropped 1 of 200 training" in warning
  # A run (and every resume: pending prompts are re-drawn from the same list) never meets it.
  source = PromptSource(task, seed=3)
  drawn = [p for _, p in source.take(2000)]
  assert max(len(codec.encode_prompt(p.prompt)) for p in drawn) <= CONTEXT.max_prompt_tokens
  task.close()


def test_too_many_over_long_rows_is_an_error_naming_them_and_the_fix(tmp_path, codec):
  rows = [_problem(i) for i in range(100)]
  for i in (5, 50, 95):
    rows[i] = {"problem": LONG + str(i), "answer": "1"}
  task = _math_task(tmp_path, rows, [_problem(i) for i in range(1000, 1020)])
  lines = [_line_of(tmp_path / "train.jsonl", LONG + str(i)) for i in (5, 50, 95)]
  with pytest.raises(prompt_check.PromptCheckError) as e:
    prompt_check.check_task_prompts(task, codec, CONTEXT, max_skip_fraction=0.01)
  msg = str(e.value)
  assert "3 of 100 training rows" in msg
  for line in lines:
    assert f"train.jsonl:{line}" in msg
  assert "raise model.max_len (to >= 263 for the longest, 253 tokens)" in msg
  assert "raise task.max_skip_fraction (now 0.01)" in msg
  assert len(task.train) == 100  # nothing dropped on error
  # The same rows under a looser limit are dropped.
  assert prompt_check.check_task_prompts(task, codec, CONTEXT, max_skip_fraction=0.05) == {
      "data/skipped_rows": 3, "data/skipped_eval_rows": 0}
  task.close()


def test_held_out_rows_are_checked_on_their_own(tmp_path, codec):
  evals = [_problem(i) for i in range(1000, 1020)]
  evals[2] = {"problem": LONG, "answer": "61"}  # 1 of 20 = 5%
  task = _math_task(tmp_path, [_problem(i) for i in range(100)], evals)
  with pytest.raises(prompt_check.PromptCheckError, match=r"1 of 20 held-out rows.*eval.jsonl:3 "):
    prompt_check.check_task_prompts(task, codec, CONTEXT, max_skip_fraction=0.01)
  out = prompt_check.check_task_prompts(task, codec, CONTEXT, max_skip_fraction=0.1)
  assert out == {"data/skipped_rows": 0, "data/skipped_eval_rows": 1}
  assert len(task.heldout) == 19 and LONG not in {p.prompt for p in task.eval_set()}
  task.close()


def test_every_row_dropped_is_an_error_even_when_allowed(codec):
  problems = [arithmetic.Problem(LONG, "1", 0)] * 3
  with pytest.raises(prompt_check.PromptCheckError, match="3 of 3"):
    prompt_check.filter_rows(problems, [p.prompt for p in problems], ["a", "b", "c"], codec,
                             CONTEXT, 1.0, "training")


class _PickyCodec:
  """A codec (no batched path) that cannot tokenize text containing "\\x00"."""

  def encode_prompt(self, text):
    if "\x00" in text:
      raise UnicodeError("cannot encode NUL")
    return np.arange(len(text) + 1, dtype=np.int32)


def test_untokenizable_and_empty_rows_are_reported():
  bad = prompt_check.find_bad_prompts(_PickyCodec(), ["ok", "a\x00b", "x" * 80, "fine"], 50,
                                      ["f:1", "f:2", "f:3", "f:4"])
  assert [(b.index, b.source, b.tokens) for b in bad] == [(1, "f:2", None), (2, "f:3", 81)]
  assert "cannot be tokenized: UnicodeError: cannot encode NUL" in bad[0].reason


def test_batched_lengths_equal_encode_prompt(codec):
  texts = ["", "What is 1?", LONG, "\n\n", "What is 12 + 7?"] * 300  # > one chunk
  assert prompt_check.prompt_lengths(codec, texts) == [len(codec.encode_prompt(t)) for t in texts]
  hf = tok_lib.build_char_tokenizer("".join(sorted(set(LONG + "=What is?"))))
  hf.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
  chat = tok_lib.TextCodec(hf, use_chat_template=True)
  assert prompt_check.prompt_lengths(chat, texts[:10]) == [
      len(chat.encode_prompt(t)) for t in texts[:10]]


@pytest.mark.parametrize("make", [lambda: arithmetic.ArithmeticTask(num_digits=5, ops="+-*"),
                                  lambda: scratchpad.ScratchpadAdditionTask(num_digits=(2, 5))])
def test_procedural_task_checks_its_longest_prompt(make):
  task = make()
  codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
  assert "99999+99999=" in task.longest_prompts()
  longest = max(len(codec.encode_prompt(p)) for p in task.longest_prompts())
  assert longest == 13  # 12 characters + bos
  sampled = task.sample(np.random.default_rng(0), 2000) + task.eval_set(50)
  assert max(len(codec.encode_prompt(p.prompt)) for p in sampled) <= longest
  fits = prompt_check.Context(max_len=longest + 8, max_tokens=8)
  assert prompt_check.check_task_prompts(task, codec, fits) == {"data/skipped_rows": 0,
                                                                "data/skipped_eval_rows": 0}
  with pytest.raises(prompt_check.PromptCheckError,
                     match=r"longest prompt '99999\+99999='.*13 tokens.*model.max_len to >= 21.*"
                           r"task.num_digits"):
    prompt_check.check_task_prompts(task, codec, prompt_check.Context(longest + 7, 8))
  task.close()


def test_run_metrics_report_the_skipped_rows():
  from jaxreplay.run import accounting  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import metrics_row  # pylint: disable=g-import-not-at-top
  from jaxreplay.data.buffer import ReplayBuffer  # pylint: disable=g-import-not-at-top
  from jaxreplay.config.defaults import base_config  # pylint: disable=g-import-not-at-top
  from jaxreplay.run.schedules import SimState  # pylint: disable=g-import-not-at-top

  class Task:
    skipped_rows, skipped_eval_rows = 3, 1

    def reward_metrics(self):
      return {}

  class Intake:
    def take_fresh_rewards(self):
      return np.zeros(0, np.float32)

    def env_metrics(self):
      return {}  # a single-turn task

    def env_counts(self):
      return {}

  c = base_config()
  metrics = metrics_row.RunMetrics.from_config(
      c, ReplayBuffer(8), accounting.ComputeAccountant(1, 1), Task(), Intake(), SimState(),
      metrics_row.MismatchProbe(lambda p, b: None, 0, (16,), 1))
  for row in (metrics.first_row({}), metrics.row(1, 1, {})):
    assert row["data/skipped_rows"] == 3.0 and row["data/skipped_eval_rows"] == 1.0
  assert c.task.max_skip_fraction == 0.01 and c.task.reward_memory_gib == 2.0


def test_10k_rows_that_fit_are_all_kept(tmp_path, codec):
  """(Its time is printed, not asserted: ~1-2 s for 10k rows on this 2-core machine.)"""
  rows = [{"problem": f"What is {i} + {2 * i} + {3 * i}?" * 3, "answer": str(6 * i)}
          for i in range(10_000)]
  task = _math_task(tmp_path, rows, [_problem(i) for i in range(100_000, 100_050)])
  t0 = time.perf_counter()
  prompt_check.check_task_prompts(task, codec, prompt_check.Context(400, 100))
  seconds = time.perf_counter() - t0
  print(f"\nchecked {len(task.train) + len(task.heldout)} prompts in {seconds:.2f} s")
  assert len(task.train) == 10_000 and task.skipped_rows == 0
  task.close()
