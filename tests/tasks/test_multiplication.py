"""The written-multiplication task: worked solutions, the exact reward, the split, the noisy teacher,
the context, and the shipped warm-start `assets/multiplication-sft` (what configs/multiplication.py
documents)."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import tasks
from jaxreplay.config import validation
from jaxreplay.models import hf_io
from jaxreplay.models import presets
from jaxreplay.run import build
from jaxreplay.sft import greedy_exact_match
from jaxreplay.sft import noise_kwargs
from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import multiplication as mul
from jaxreplay.tasks import tokenizer
from tests.helpers.paths import REPO

SFT = os.path.join(REPO, "assets", "multiplication-sft")
UNK = tokenizer.SPECIAL_TOKENS.index("<unk>")


def _config():
  from configs import multiplication  # pylint: disable=g-import-not-at-top
  return multiplication.get_config()


def _large_batch_config():
  from configs import multiplication_large_batch  # pylint: disable=g-import-not-at-top
  return multiplication_large_batch.get_config()


def _reference(a: int, y: int) -> str:
  """The worked solution written out independently of `multiplication._columns`."""
  cols, carry = [], 0
  for ch in reversed(str(a)):
    v = int(ch) * y + carry
    cols.append(f"{ch}*{y}+{carry}={v:02d}")
    carry = v // 10
  return ",".join(cols) + ";" + str(a * y)


def _columns_of(text: str) -> list[tuple[int, int, int, int]]:
  """[(x, y, carry_in, value)] parsed from a worked solution's body ("x*y+c=vv,...")."""
  body = text.split(";")[0]
  return [(int(c[0]), int(c[2]), int(c[4]), int(c[6:8])) for c in body.split(",")]


def test_worked_solutions():
  assert mul.worked_solution(4738, 7) == "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;33166"
  assert mul.worked_solution(1234, 2) == "4*2+0=08,3*2+0=06,2*2+0=04,1*2+0=02;2468"
  assert mul.worked_solution(10, 9) == "0*9+0=00,1*9+0=09;90"
  assert mul.worked_solution(99, 9) == "9*9+0=81,9*9+8=89;891"
  assert mul.worked_solution(0, 5) == "0*5+0=00;0"
  rng = np.random.default_rng(0)
  for a, y in zip(rng.integers(0, 10 ** 7, 300), rng.integers(1, 10, 300)):
    sol = mul.worked_solution(int(a), int(y))
    assert sol == _reference(int(a), int(y))
    assert mul.final_answer(sol) == str(a * y)
  assert mul.final_answer("8*7+0=56") is None
  for y in (0, 10):
    with pytest.raises(ValueError, match="digit y in 1..9"):
      mul.worked_solution(12, y)
  with pytest.raises(ValueError, match="a >= 0"):
    mul.worked_solution(-3, 4)


def test_problems_charset_and_lengths():
  task = mul.WrittenMultiplicationTask(num_digits=(2, 6), seed=0)
  codec = tokenizer.TextCodec(tokenizer.build_char_tokenizer(task.charset))
  lengths = {}
  for p in task.sample(np.random.default_rng(0), 2000):
    a, y = (int(x) for x in p.prompt[:-1].split("*"))
    assert p.prompt == f"{a}*{y}=" and 10 <= a < 10 ** 6 and y in mul.MULTIPLIERS
    assert p.answer == mul.worked_solution(a, y) and p.id == arithmetic.problem_id(p.prompt)
    assert set(p.prompt + p.answer) <= set(task.charset)
    tokens = codec.encode(p.answer, add_bos=False)
    assert UNK not in tokens and codec.decode(tokens) == p.answer
    assert len(tokens) + 1 <= task.max_completion_tokens()  # + eos
    lengths.setdefault(len(str(a)), set()).add(len(p.answer))
  # Every digit count of the range is drawn; a completion has 10 n or 10 n + 1 characters.
  assert sorted(lengths) == [2, 3, 4, 5, 6]
  assert all(s <= {10 * n, 10 * n + 1} for n, s in lengths.items())
  longest = mul.worked_solution(999999, 9)
  assert len(longest) + 1 == task.max_completion_tokens() == 62
  assert task.longest_prompts() == ["999999*9="]
  assert task.num_problems == 8 * (10 ** 6 - 10)


def test_reward_is_exact_and_checks_every_step():
  task = mul.WrittenMultiplicationTask(num_digits=(2, 6))
  p = task._make(4738, "*", 7)  # pylint: disable=protected-access
  right = "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;33166"
  assert p.prompt == "4738*7=" and p.answer == right
  assert task.reward(right, p) == 1.0
  assert task.reward(" " + right + "\n", p) == 1.0  # surrounding whitespace is not part of it
  wrong = [
      "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;33167",  # wrong result
      "8*7+0=56,3*7+0=21,7*7+2=51,4*7+5=33;33116",  # a dropped carry, consistent result
      "8*7+0=56,3*7+5=26,7*7+2=58,4*7+5=33;33866",  # a misremembered 7*7 (= 8*7), carried on
      "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;3166",   # the final carry dropped from the result
  ]
  malformed = [
      "33166",                                        # the right result without the steps
      ";33166",
      "8*7+0=56,3*7+5=26,7*7+2=51;33166",             # a column missing
      "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33",          # no result
      "8*7+0=56 3*7+5=26 7*7+2=51 4*7+5=33;33166",    # wrong separators
      "8*7=56,3*7+5=26,7*7+2=51,4*7+5=33;33166",      # a carry not written
      "8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;033166",   # a leading zero
      right + ";33166", right + "0", "", right[:-1],
  ]
  for text in wrong + malformed:
    assert task.reward(text, p) == 0.0, text
  scores = task.score_batch([right, wrong[2], malformed[0]], [p, p, p])
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
  assert task.reward_metrics()["reward/calls"] == 3
  task.close()


def test_heldout_and_training_problems_never_overlap():
  task = mul.WrittenMultiplicationTask(num_digits=(2, 6), seed=0)
  evalset = task.eval_set(1024)
  assert len({p.prompt for p in evalset}) == 1024
  assert all(task.is_heldout(p) for p in evalset)
  train = task.sample(np.random.default_rng(1), 5000)
  assert not {p.prompt for p in train} & {p.prompt for p in evalset}
  assert not any(task.is_heldout(p) for p in train)
  sft_prompts = {q for q, _ in task.sft_examples(3000, slip=0.4)}
  assert not sft_prompts & {p.prompt for p in evalset}
  assert mul.WrittenMultiplicationTask(num_digits=(2, 6), seed=0).eval_set(64) == evalset[:64]
  # The split is the arithmetic tasks' hash of (seed, prompt): another seed splits differently.
  other = {p.prompt for p in mul.WrittenMultiplicationTask(num_digits=(2, 6), seed=1).eval_set(64)}
  assert other != {p.prompt for p in evalset[:64]}
  assert all(arithmetic.is_heldout(q, 0.1, 1) for q in other)


def test_misconceptions_follow_their_definition():
  table = mul.misconceptions(0.4, (0.4, 0.95), seed=0)
  assert 216 <= len(table) <= 296  # ~40% of the 640 facts (4 standard deviations)
  for (x, y, c), (prob, wrong) in table.items():
    assert x in mul.TABLE and y in mul.TABLE and c in mul.CARRIES
    assert 0.4 <= prob <= 0.95 and wrong in ((x - 1) * y + c, (x + 1) * y + c)
    assert 0 <= wrong <= 99
  assert mul.misconceptions(0.4, (0.4, 0.95), seed=0) == table
  assert mul.misconceptions(0.4, (0.4, 0.95), seed=1) != table
  assert not mul.misconceptions(0.0, (0.4, 0.95), seed=0)
  assert len(mul.misconceptions(1.0, (0.4, 0.95), seed=0)) == 640
  with pytest.raises(ValueError, match="slip="):
    mul.misconceptions(1.5, (0.4, 0.95), seed=0)
  with pytest.raises(ValueError, match="slip_range"):
    mul.misconceptions(0.5, (0.9, 0.4), seed=0)


def test_noisy_teacher_slips_at_its_facts_rates():
  task = mul.WrittenMultiplicationTask(num_digits=(2, 6))
  clean = list(task.sft_examples(3000, seed=1))
  assert clean == list(task.sft_examples(3000, seed=1, slip=0.0))
  assert all(t == mul.worked_solution(*(int(x) for x in q[:-1].split("*"))) for q, t in clean)
  table = mul.misconceptions(0.4, (0.4, 0.95), seed=task.seed)
  noisy = list(task.sft_examples(3000, seed=1, slip=0.4))
  assert [q for q, _ in noisy] == [q for q, _ in clean]  # same prompts, only targets differ
  slips = {fact: [0, 0] for fact in table}  # fact -> [columns where it was used, slips]
  for (prompt, right), (_, target) in zip(clean, noisy):
    a, y = (int(x) for x in prompt[:-1].split("*"))
    cols = _columns_of(target)
    assert [x for x, *_ in cols] == [int(ch) for ch in reversed(str(a))]
    carry = 0
    for x, y_, c, v in cols:
      assert y_ == y and c == carry  # carries follow the written values
      if (x, y, c) in table:
        slips[(x, y, c)][0] += 1
        slips[(x, y, c)][1] += v != x * y + c
        assert v in (x * y + c, table[(x, y, c)][1])
      else:
        assert v == x * y + c
      carry = v // 10
    assert target == mul.render(cols)  # the result is read off the written values
    assert (target == right) == all(v == x * y_ + c for x, y_, c, v in cols)
  # Each fact slips at its own probability: binomial counts within 4 standard deviations (facts
  # seen >= 30 times), and all slips together at the use-weighted mean probability.
  seen = {fact: nk for fact, nk in slips.items() if nk[0]}
  assert len([1 for n, _ in seen.values() if n >= 30]) >= 30
  for fact, (n, k) in seen.items():
    prob = table[fact][0]
    if n >= 30:
      assert abs(k - n * prob) < 4 * np.sqrt(n * prob * (1 - prob)) + 1, (fact, n, k, prob)
  uses = sum(n for n, _ in seen.values())
  expected = sum(n * table[fact][0] for fact, (n, _) in seen.items())
  total = sum(k for _, k in seen.values())
  assert abs(total - expected) < 4 * np.sqrt(expected) + 1, (total, expected, uses)
  with pytest.raises(ValueError, match="slip"):
    next(task.sft_examples(1, slip=2.0))


def test_configs_validate_and_build_the_task():
  c, large = _config(), _large_batch_config()
  for config in (c, large):
    validation.validate_config(config)
  assert large.task == c.task and large.model == c.model
  assert large.buffer.size == 4 * large.buffer.batch_size
  assert isinstance(tasks.make_task("multiplication", num_digits=(2, 3)),
                    mul.WrittenMultiplicationTask)
  bad = _config()
  bad.task.num_digits = (0, 3)
  with pytest.raises(ValueError, match="task.num_digits"):
    validation.validate_config(bad)


def test_config_builds_the_task_fits_the_context_and_takes_the_noise():
  c = _config()
  task = build.make_task(c.task)
  assert isinstance(task, mul.WrittenMultiplicationTask)
  assert task.num_digits == tuple(c.task.num_digits)
  assert c.rollout.max_tokens >= task.max_completion_tokens()
  codec = tokenizer.TextCodec(tokenizer.build_char_tokenizer(task.charset))
  longest = len(codec.encode_prompt(task.longest_prompts()[0]))
  assert longest + c.rollout.max_tokens <= c.model.max_len
  assert longest + task.max_completion_tokens() <= c.model.max_len  # an SFT row fits
  assert all(len(codec.encode_prompt(p.prompt)) <= longest for p in task.eval_set(256))
  assert noise_kwargs(c.sft, "multiplication") == {"slip": c.sft.slip,
                                                   "slip_range": tuple(c.sft.slip_range)}
  task.close()


# ---- the shipped warm-start -----------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_start():
  cfg, params = hf_io.load_hf(SFT, dtype=jnp.float32)
  return cfg, params, tokenizer.load_tokenizer(SFT)


def test_warm_start_tokenizer_matches_model_and_task(warm_start):
  cfg, _, codec = warm_start
  tokenizer.check_tokenizer_matches_model(codec, cfg)
  c = _config()
  preset = presets.PRESETS[c.model.preset]()
  assert (cfg.num_hidden_layers, cfg.hidden_size) == (preset.num_hidden_layers, preset.hidden_size)
  task = build.make_task(c.task)
  for p in task.eval_set(16):
    assert codec.decode(codec.encode_prompt(p.prompt)) == p.prompt
    assert codec.decode(codec.encode(p.answer, add_bos=False)) == p.answer
    assert UNK not in codec.encode(p.prompt + p.answer)
  task.close()


def test_warm_start_greedy_accuracy_in_documented_range(warm_start):
  cfg, params, codec = warm_start
  c = _config()
  task = build.make_task(c.task)
  problems = task.eval_set(512)
  right = greedy_exact_match(cfg, params, codec, [(p.prompt, p.answer) for p in problems],
                             c.model.max_len)
  lo, hi = WARM_START_GREEDY
  assert lo < right.mean() < hi, right.mean()
  cols = np.array([p.answer.count(",") + 1 for p in problems])
  # Difficulty follows length: the shortest problems are right far more often than the longest.
  assert right[cols == cols.min()].mean() > right[cols == cols.max()].mean() + 0.1
  task.close()


WARM_START_GREEDY = (0.12, 0.32)  # held-out greedy exact match of assets/multiplication-sft
