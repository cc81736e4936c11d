"""Math datasets in the formats users have (`tasks.math_data`): parquet (pyarrow, a core
dependency), JSONL and JSON, a separate held-out file, the held-out split, and messages that name
the row."""
import json

import numpy as np
import pytest

from jaxreplay import tasks
from jaxreplay.tasks import math_data, prompt_check, tokenizer as tok_lib
from tests.helpers.deps import require

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
    held = [r["problem"] for r in ROWS[:2]] + [long_row["problem"]]
    assert [p.prompt for p in task.heldout] == held
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


@pytest.mark.slow
def test_math_run_with_parquet_eval_file_plugin_reward_and_chat_template(tmp_path):
  """`python -m jaxreplay.launch` on the math task as a user sets it up: parquet training data, a
  separate eval file, a reward plug-in, a tokenizer with Qwen3's special tokens, chat template and
  generation_config eos ids (small ids: the tiny preset is sized to it), the async schedule."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_runs  # pylint: disable=g-import-not-at-top
  from tests.helpers.chat_templates import QWEN3  # pylint: disable=g-import-not-at-top
  from tests.helpers.tokenizer_files import write_tokenizer  # pylint: disable=g-import-not-at-top
  special = {"<|endoftext|>": 97, "<|im_start|>": 98, "<|im_end|>": 99}
  tok_dir = tmp_path / "tokenizer"
  write_tokenizer(str(tok_dir), special, {"<think>": 100, "</think>": 101}, QWEN3,
                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [99, 97]}))
  write_parquet(tmp_path / "train.parquet", ROWS)
  with open(tmp_path / "eval.jsonl", "w") as f:
    f.writelines(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                 for i in range(4))
  workdir = tmp_path / "run"
  cmd = [tiny_runs.sys.executable, "-m", "jaxreplay.launch",
         f"--config={tiny_runs.REPO}/configs/tiny.py", f"--workdir={workdir}",
         "--config.model.path=", f"--config.model.tokenizer={tok_dir}", "--config.model.max_len=96",
         "--config.task.name=math", f"--config.task.path={tmp_path / 'train.parquet'}",
         f"--config.task.eval_path={tmp_path / 'eval.jsonl'}", "--config.task.template=plain",
         "--config.task.reward_fn=tests.helpers.reward_plugins:digits",
         "--config.task.num_reward_workers=2",
         "--config.scheduler.kind=async", "--config.rollout.backend=jax",
         "--config.rollout.num_workers=2", "--config.rollout.group_size=4",
         "--config.rollout.max_tokens=8", "--config.buffer.size=32",
         "--config.buffer.batch_size=16",
         "--config.total_steps=3", "--config.trainer.warmup_steps=1", "--config.eval.every=3",
         "--config.eval.num_problems=4", "--config.eval.n_samples=2", "--config.eval.ks=(1,2)",
         "--config.trainer.buckets=(64,96)", "--config.checkpoint.every=3"]
  # The plug-in is tests.helpers.reward_plugins: the repository root on the run's path finds it.
  env = dict(tiny_runs.ENV, PYTHONPATH=os.pathsep.join(
      [tiny_runs.REPO, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run(cmd, cwd=tiny_runs.REPO, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "stop ids [99, 97], chat template on" in proc.stderr
  rows = tiny_runs.read_rows(str(workdir))
  assert rows[-1]["step"] == 3
  assert rows[-1]["reward/calls"] >= 3 * 16 and rows[-1]["reward/errors"] == 0
  assert "eval/pass@1" in rows[-1]
  config = json.load(open(workdir / "run_config.json"))
  assert config["task"]["reward_fn"] == "tests.helpers.reward_plugins:digits"


# ---- JSONL / JSON datasets, the held-out split, row sources -------------------------------------

def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


DATASET_ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "extra": i} for i in range(40)]


def test_load_math_dataset_jsonl_json_and_dir(tmp_path):
  _write_jsonl(tmp_path / "a.jsonl", DATASET_ROWS[:30] + [{"problem": "", "answer": "1"}])
  with open(tmp_path / "b.json", "w") as f:
    json.dump(DATASET_ROWS[30:], f)
  problems = math_data.load_math_dataset(str(tmp_path / "a.jsonl"), template="plain")
  assert [p.prompt for p in problems] == [r["problem"] for r in DATASET_ROWS[:30]]  # empty row skipped
  assert [p.answer for p in problems] == [r["answer"] for r in DATASET_ROWS[:30]]
  both = math_data.load_math_dataset(str(tmp_path))  # the directory: a.jsonl then b.json
  assert len(both) == 40
  assert both[-1].prompt == math_data.PROMPT_TEMPLATES["qwen_math"].format(problem=DATASET_ROWS[-1]["problem"])
  assert "\\boxed{}" in both[-1].prompt
  assert len(math_data.load_math_dataset(str(tmp_path), max_examples=5)) == 5
  custom = math_data.load_math_dataset(str(tmp_path / "b.json"), template="Q: {problem}\nA:")
  assert custom[0].prompt == f"Q: {DATASET_ROWS[30]['problem']}\nA:"


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
  _write_jsonl(tmp_path / "train.jsonl", DATASET_ROWS)
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
  _write_jsonl(tmp_path / "test.jsonl", DATASET_ROWS[:5])
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
