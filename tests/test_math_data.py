"""Math datasets in the formats users have: parquet (pyarrow, a core dependency), JSONL and JSON,
a separate held-out file, and messages that name the row."""
import json

import pytest

from conftest import require
from jaxreplay.tasks import math_data, prompt_check, tokenizer as tok_lib

pa = require("pyarrow")
pq = require("pyarrow.parquet")


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))


ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 5}
        for i in range(12)]


def test_parquet_rows_load_with_file_row_sources(tmp_path):
  rows = ROWS[:4] + [{"problem": "", "answer": "1", "level": 0}] + ROWS[4:6]  # row 5: skipped
  write_parquet(tmp_path / "train.parquet", rows)
  problems, sources = math_data.load_math_records(str(tmp_path / "train.parquet"),
                                                  template="plain")
  assert [p.prompt for p in problems] == [r["problem"] for r in ROWS[:6]]
  assert [p.answer for p in problems] == [r["answer"] for r in ROWS[:6]]
  path = tmp_path / "train.parquet"
  assert sources == [f"{path}:row {i}" for i in (1, 2, 3, 4, 6, 7)]
  # Other field names, and non-string answers (an int column) become strings.
  write_parquet(tmp_path / "other.parquet", [{"question": "1+1?", "solution": 2}])
  other = math_data.load_math_dataset(str(tmp_path / "other.parquet"), problem_key="question",
                                      answer_key="solution", template="plain")
  assert (other[0].prompt, other[0].answer) == ("1+1?", "2")
  with pytest.raises(ValueError, match=r"other.parquet:row 1: the row has no field 'problem'"):
    math_data.load_math_dataset(str(tmp_path / "other.parquet"))


def test_a_directory_mixes_jsonl_json_and_parquet_in_sorted_order(tmp_path):
  with open(tmp_path / "a.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in ROWS[:3])
  with open(tmp_path / "b.json", "w") as f:
    json.dump(ROWS[3:5], f)
  write_parquet(tmp_path / "c.parquet", ROWS[5:8])
  problems, sources = math_data.load_math_records(str(tmp_path), template="plain")
  assert [p.prompt for p in problems] == [r["problem"] for r in ROWS[:8]]
  assert [s.rsplit("/", 1)[1] for s in sources] == [
      "a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "b.json:row 1", "b.json:row 2",
      "c.parquet:row 1", "c.parquet:row 2", "c.parquet:row 3"]


def test_parquet_eval_file_and_an_over_long_row_named_by_file_and_row(tmp_path):
  long_row = {"problem": "What is " + "9 + " * 80 + "9?", "answer": "729", "level": 5}
  write_parquet(tmp_path / "train.parquet", ROWS[:8] + [long_row])
  write_parquet(tmp_path / "test.parquet", ROWS[:2] + [long_row])   # MATH-500-like eval file
  task = math_data.MathTask.from_files(str(tmp_path / "train.parquet"),
                                       eval_path=str(tmp_path / "test.parquet"), template="plain")
  try:
    # The eval problems (ROWS[:2] and the long one) are removed from training.
    assert [p.prompt for p in task.heldout] == [r["problem"] for r in ROWS[:2]] + [long_row["problem"]]
    assert [p.prompt for p in task.train] == [r["problem"] for r in ROWS[2:8]]
    assert task.heldout_sources[-1] == f"{tmp_path / 'test.parquet'}:row 3"
    codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
    context = prompt_check.Context(max_len=128, max_tokens=32)  # prompts up to 96 tokens
    with pytest.raises(ValueError, match=r"test.parquet:row 3"):
      prompt_check.check_task_prompts(task, codec, context, max_skip_fraction=0.0)
    skipped = prompt_check.check_task_prompts(task, codec, context, max_skip_fraction=0.5)
    assert skipped == {"data/skipped_rows": 0, "data/skipped_eval_rows": 1}
    assert len(task.heldout) == 2 and task.heldout_sources[-1].endswith("test.parquet:row 2")
  finally:
    task.close()
