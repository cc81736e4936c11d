"""Tests of the tokenizer, the arithmetic task and math dataset loading."""
import json

import numpy as np
import pytest

from conftest import require
from jaxreplay.config import validation
from jaxreplay import tasks
from jaxreplay.models.config import ModelConfig
from jaxreplay.tasks import arithmetic, math_data, tokenizer as tok_lib

transformers = require("transformers")

TEXTS = ["12+7=19", " 1  2 \n3 ", "", "99*99=9801\n\n", "0-0="]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tok"))
  tok_lib.build_char_tokenizer(arithmetic.ArithmeticTask().charset, out_dir=out)
  return out


# ---- tokenizer -----------------------------------------------------------------------------


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


# ---- arithmetic ------------------------------------------------------------------------------


def test_arithmetic_problems_are_correct():
  task = arithmetic.ArithmeticTask(num_digits=(1, 3), ops="+-*", seed=3)
  for p in task.sample(np.random.default_rng(0), 300):
    a, rest = p.prompt[:-1], p.prompt[-1]
    assert rest == "="
    assert str(eval(a)) == p.answer  # pylint: disable=eval-used
    assert int(p.answer) >= 0  # allow_negative=False orders subtraction operands
    assert p.id == arithmetic.problem_id(p.prompt)
    assert set(p.prompt + p.answer) <= set(task.charset)


def test_arithmetic_reward_is_exact():
  task = arithmetic.ArithmeticTask()
  p = arithmetic.Problem("12+7=", "19", 0)
  assert task.reward("19", p) == 1.0
  assert task.reward(" 19 \nsomething else", p) == 1.0  # up to the first newline, stripped
  for wrong in ["190", "1 9", "19.0", "", "\n19", "-19", "019", "9"]:
    assert task.reward(wrong, p) == 0.0, wrong
  scores = task.score_batch(["19", "18", "19\n"], [p, p, p])
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, [1.0, 0.0, 1.0])
  assert task.reward_metrics() == {"reward/calls": 3, "reward/errors": 0, "reward/timeouts": 0,
                                   "reward/memory_errors": 0, "reward/restarts": 0}
  task.close()


def test_arithmetic_splits_disjoint_and_deterministic():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+-", seed=0, heldout_fraction=0.2)
  evalset = task.eval_set(200)
  assert len({p.prompt for p in evalset}) == 200
  assert all(task.is_heldout(p) for p in evalset)
  train = task.sample(np.random.default_rng(1), 2000)
  assert not {p.prompt for p in train} & {p.prompt for p in evalset}
  assert not any(task.is_heldout(p) for p in train)
  # Same seed -> same eval set; the eval set does not depend on the training rng.
  assert arithmetic.ArithmeticTask(seed=0, heldout_fraction=0.2).eval_set(200) == evalset
  assert task.sample(np.random.default_rng(1), 50) == train[:50]
  assert task.sample(np.random.default_rng(2), 50) != train[:50]
  other = arithmetic.ArithmeticTask(seed=1, heldout_fraction=0.2).eval_set(200)
  assert {p.prompt for p in other} != {p.prompt for p in evalset}
  # The held-out share of the whole space is close to the fraction (space of 2 * 100^2 problems).
  prompts = [f"{a}{op}{b}=" for a in range(100) for b in range(100) for op in "+-"]
  share = np.mean([arithmetic.is_heldout(q, 0.2, 0) for q in prompts])
  assert abs(share - 0.2) < 0.01


def test_arithmetic_eval_set_too_small_and_bad_args():
  task = arithmetic.ArithmeticTask(num_digits=(1, 1), ops="+", heldout_fraction=0.05)
  assert task.num_problems == 100
  with pytest.raises(ValueError, match="distinct held-out problems"):
    task.eval_set(50)
  with pytest.raises(ValueError, match="ops"):
    arithmetic.ArithmeticTask(ops="/")
  with pytest.raises(ValueError, match="num_digits"):
    arithmetic.ArithmeticTask(num_digits=(3, 2))


def test_arithmetic_sft_examples():
  task = arithmetic.ArithmeticTask(num_digits=(2, 2), ops="+-*")
  pairs = list(task.sft_examples(100))
  assert len(pairs) == 100 and pairs == list(task.sft_examples(100))
  for prompt, target in pairs:
    assert str(eval(prompt[:-1])) == target  # pylint: disable=eval-used
    assert not arithmetic.is_heldout(prompt, task.heldout_fraction, task.seed)


# ---- math datasets --------------------------------------------------------------------------


def test_carry_free_sum_against_digitwise_reference():
  rng = np.random.default_rng(0)
  for a, b in [(47, 38), (57, 68), (50, 50), (12, 7), (0, 0), (99, 1), *rng.integers(0, 10**4, (200, 2))]:
    a, b = int(a), int(b)
    da, db = str(a).zfill(6), str(b).zfill(6)
    expect = str(int("".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db))))
    assert arithmetic.carry_free_sum(a, b) == expect
    no_carry = all(int(x) + int(y) < 10 for x, y in zip(da, db))
    assert (arithmetic.carry_free_sum(a, b) == str(a + b)) == no_carry
  with pytest.raises(ValueError, match="non-negative"):
    arithmetic.carry_free_sum(-1, 2)


def test_arithmetic_sft_examples_carry_drop():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+")
  clean = list(task.sft_examples(3000, seed=1))
  noisy = list(task.sft_examples(3000, seed=1, carry_drop=0.5))
  assert [p for p, _ in clean] == [p for p, _ in noisy]          # same prompts, only targets differ
  carries = wrong = 0
  for (prompt, answer), (_, target) in zip(clean, noisy):
    a, b = (int(x) for x in prompt[:-1].split("+"))
    assert answer == str(a + b)
    has_carry = arithmetic.carry_free_sum(a, b) != answer
    carries += has_carry
    if target != answer:
      wrong += 1
      assert has_carry and target == arithmetic.carry_free_sum(a, b)
  assert 0.45 < wrong / carries < 0.55                            # binomial sd ~0.012 here
  assert all(t == a for (_, a), (_, t) in zip(clean, task.sft_examples(3000, seed=1, carry_drop=0.0)))
  with pytest.raises(ValueError, match="carry_drop"):
    next(task.sft_examples(1, carry_drop=1.5))


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "extra": i} for i in range(40)]


def test_load_math_dataset_jsonl_json_and_dir(tmp_path):
  _write_jsonl(tmp_path / "a.jsonl", ROWS[:30] + [{"problem": "", "answer": "1"}])
  with open(tmp_path / "b.json", "w") as f:
    json.dump(ROWS[30:], f)
  problems = math_data.load_math_dataset(str(tmp_path / "a.jsonl"), template="plain")
  assert [p.prompt for p in problems] == [r["problem"] for r in ROWS[:30]]  # empty row skipped
  assert [p.answer for p in problems] == [r["answer"] for r in ROWS[:30]]
  both = math_data.load_math_dataset(str(tmp_path))  # the directory: a.jsonl then b.json
  assert len(both) == 40
  assert both[-1].prompt == math_data.PROMPT_TEMPLATES["qwen_math"].format(problem=ROWS[-1]["problem"])
  assert "\\boxed{}" in both[-1].prompt
  assert len(math_data.load_math_dataset(str(tmp_path), max_examples=5)) == 5
  custom = math_data.load_math_dataset(str(tmp_path / "b.json"), template="Q: {problem}\nA:")
  assert custom[0].prompt == f"Q: {ROWS[30]['problem']}\nA:"


def test_load_math_dataset_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    math_data.load_math_dataset(str(tmp_path / "missing.jsonl"))
  _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "solution": "2"}])
  with pytest.raises(ValueError, match=r"no field 'problem'.*\['question', 'solution'\]"):
    math_data.load_math_dataset(str(tmp_path / "d.jsonl"))
  ok = math_data.load_math_dataset(str(tmp_path / "d.jsonl"), problem_key="question",
                                   answer_key="solution")
  assert ok[0].answer == "2"
  (tmp_path / "bad.jsonl").write_text('{"problem": "x", "answer": "1"}\n{not json\n')
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    math_data.load_math_dataset(str(tmp_path / "bad.jsonl"))
  with pytest.raises(ValueError, match="template"):
    math_data.load_math_dataset(str(tmp_path / "d.jsonl"), template="nope")
  (tmp_path / "x.parquet").write_bytes(b"PAR1")  # a truncated download
  with pytest.raises(ValueError, match=r"x.parquet: not a readable parquet file"):
    math_data.load_math_dataset(str(tmp_path / "x.parquet"))


def test_math_task_split_and_sampling(tmp_path):
  _write_jsonl(tmp_path / "train.jsonl", ROWS)
  task = tasks.make_task("math", path=str(tmp_path / "train.jsonl"), heldout_fraction=0.25)
  assert len(task.train) + len(task.heldout) == 40
  assert not {p.prompt for p in task.train} & {p.prompt for p in task.heldout}
  again = tasks.make_task("math", path=str(tmp_path / "train.jsonl"), heldout_fraction=0.25)
  assert again.heldout == task.heldout
  drawn = task.sample(np.random.default_rng(0), 100)
  assert {p.prompt for p in drawn} <= {p.prompt for p in task.train}
  assert task.eval_set(3) == task.heldout[:3]
  assert set(task.charset) >= set("".join(p.prompt + p.answer for p in task.train))
  # A separate eval file: its problems are removed from training.
  _write_jsonl(tmp_path / "test.jsonl", ROWS[:5])
  split = math_data.MathTask.from_files(str(tmp_path / "train.jsonl"),
                                        eval_path=str(tmp_path / "test.jsonl"))
  assert len(split.heldout) == 5 and len(split.train) == 35
  for t in (task, again, split):
    t.close()


def test_math_rows_keep_their_file_and_line(tmp_path):
  (tmp_path / "a.jsonl").write_text('\ufeff{"problem": "p1", "answer": "1"}\n\n'  # BOM, blank
                                    '{"problem": "", "answer": "1"}\n'            # skipped row
                                    '{"problem": "p4", "answer": "4"}\n', encoding="utf-8")
  with open(tmp_path / "b.json", "w") as f:
    json.dump([{"problem": "q1", "answer": "1"}, {"problem": "q2", "answer": "2"}], f)
  problems, sources = math_data.load_math_records(str(tmp_path), template="plain")
  assert [p.prompt for p in problems] == ["p1", "p4", "q1", "q2"]
  assert sources == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'a.jsonl'}:4",
                     f"{tmp_path / 'b.json'}:row 1", f"{tmp_path / 'b.json'}:row 2"]
  task = math_data.MathTask.from_files(str(tmp_path / "a.jsonl"),
                                       eval_path=str(tmp_path / "b.json"), template="plain")
  assert task.train_sources == sources[:2] and task.heldout_sources == sources[2:]
  assert (task.skipped_rows, task.skipped_eval_rows) == (0, 0)
  task.close()


def test_non_utf8_dataset_names_file_line_byte_offset_and_fix(tmp_path):
  good = b'{"problem": "1+1?", "answer": "2"}\n'
  bad = b'{"problem": "caf\xe9?", "answer": "3"}\n'  # Latin-1 e-acute
  (tmp_path / "d.jsonl").write_bytes(good * 3 + bad + good)
  offset = 3 * len(good) + bad.index(b"\xe9")
  with pytest.raises(ValueError) as e:
    math_data.load_math_dataset(str(tmp_path / "d.jsonl"))
  msg = str(e.value)
  assert f"d.jsonl:4: not UTF-8 at byte offset {offset} " in msg
  assert "b'\\xe9?\"," in msg and "iconv -f latin1 -t utf-8" in msg
  (tmp_path / "d.json").write_bytes(b"[\n" + good.rstrip() + b",\n" + bad.rstrip() + b"\n]\n")
  offset = len(b"[\n" + good.rstrip() + b",\n") + bad.index(b"\xe9")
  with pytest.raises(ValueError, match=rf"d.json:3: not UTF-8 at byte offset {offset} "):
    math_data.load_math_dataset(str(tmp_path / "d.json"))


def test_digit_range_and_num_digits_5():
  assert arithmetic.digit_range(5) == (5, 5)
  assert arithmetic.digit_range((5,)) == (5, 5)  # what --config.task.num_digits=5 parses to
  assert arithmetic.digit_range([2, 4]) == (2, 4)
  assert arithmetic.digit_range(np.int64(3)) == (3, 3)
  for bad in (0, 19, (3, 2), (1, 2, 3), (), "5", 2.0, True, (1, 19)):
    with pytest.raises(ValueError, match=r"expected an int n .* 1 <= lo <= hi <= 18"):
      arithmetic.digit_range(bad)
  for num_digits in (5, (5,)):
    task = arithmetic.ArithmeticTask(num_digits=num_digits, ops="+-*")
    assert task.num_digits == (5, 5)
    for p in task.sample(np.random.default_rng(0), 50) + task.eval_set(10):
      a, b = (int(x) for x in p.prompt[:-1].replace("*", "+").replace("-", "+").split("+"))
      assert 10_000 <= min(a, b) and max(a, b) <= 99_999
    task.close()


def test_build_accepts_num_digits_5_and_names_bad_task_keys():
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  from jaxreplay.config.defaults import base_config  # pylint: disable=g-import-not-at-top
  c = base_config()
  c.task.num_digits = (5,)  # as --config.task.num_digits=5 sets it
  validation.validate_config(c)
  task = build.make_task(c.task)
  assert task.num_digits == (5, 5)
  task.close()
  c.task.num_digits = (0, 3)
  c.task.max_skip_fraction = 1.5
  c.task.reward_memory_gib = 0.0
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  assert "task.num_digits=(0, 3)" in str(e.value)
  assert "task.max_skip_fraction=1.5 must be in [0, 1]" in str(e.value)
  assert "task.reward_memory_gib=0.0 must be > 0" in str(e.value)


def test_make_task_errors():
  assert isinstance(tasks.make_task("arithmetic", num_digits=(1, 1)), arithmetic.ArithmeticTask)
  with pytest.raises(ValueError, match="needs path"):
    tasks.make_task("math")
  with pytest.raises(ValueError, match="unknown task"):
    tasks.make_task("lean")
