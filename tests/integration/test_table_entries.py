"""Adding a thing is one table entry: a toy rollout backend (`rollout.backend_table.BACKENDS`), a
toy buffer sampler (`data.samplers.SAMPLERS`) and a toy schedule (`config.schedule_table.SCHEDULES`)
added as one entry each run a whole (short) run in this process, through validation, the resolved
config, build, the schedule and the metrics rows; removed, their names are refused again."""
import importlib.util
import os

import pytest

from jaxreplay.config import schedule_table
from jaxreplay.config import validation
from jaxreplay.data import samplers
from jaxreplay.rollout import backend_table
from tests.helpers import tiny_runs
from tests.helpers import toy_entries
from tests.helpers.paths import REPO



def tiny_config():
  spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(REPO, "configs",
                                                                          "tiny.py"))
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  c = tiny.get_config()
  c.total_steps, c.trainer.warmup_steps = 3, 1
  c.rollout.group_size, c.rollout.prompts_per_request = 4, 4
  c.buffer.size, c.buffer.batch_size = 64, 16
  c.eval.every, c.eval.num_problems, c.eval.n_samples, c.eval.ks = 3, 8, 2, (1, 2)
  c.checkpoint.every = 3
  return c


@pytest.mark.slow
def test_a_toy_backend_sampler_and_schedule_run_a_whole_run(tmp_path, monkeypatch):
  from jaxreplay.run import pipeline  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(backend_table.BACKENDS, "toy", toy_entries.TOY_BACKEND)
  monkeypatch.setitem(samplers.SAMPLERS, "oldest", toy_entries.oldest_sampler)
  monkeypatch.setitem(schedule_table.SCHEDULES, "toy", toy_entries.TOY_SCHEDULE)
  toy_entries.MADE.clear()
  c = tiny_config()
  c.rollout.backend, c.buffer.priority, c.scheduler.kind = "toy", "oldest", "toy"
  workdir = str(tmp_path / "run")
  summary = pipeline.run(c, workdir)
  assert c.eval.backend == "auto"  # the run resolved a frozen copy; the caller's config is as it was
  assert summary["step"] == 3 and "eval/pass@1" in summary
  rows = tiny_runs.read_rows(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert all(r["buffer/batch_use_count_max"] >= 1 for r in rows[1:])
  made = toy_entries.MADE
  assert len(made) == 1 and made[0].calls >= 3  # the simulated schedule's one local worker
  added = rows[-1]["buffer/total_added"]  # whole requests; the simulated in-flight ones not yet
  assert 16 <= added <= 16 * made[0].calls and added % 16 == 0  # a batch needs B = 16 held
  monkeypatch.undo()
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  for text in ("rollout.backend='toy'", "buffer.priority='oldest'", "scheduler.kind='toy'"):
    assert text in str(e.value)
