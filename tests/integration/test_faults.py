"""Fault injection on whole runs (`python -m jaxreplay.launch`, the shortened tiny config).

After each fault the run either resumes and ends exactly where an uninterrupted run ends (metric
rows, buffer, prompt cursor, simulated clock: bit for bit), or stops with a named error and
nothing bad on disk:
  kill -9 at two points (the simulated schedule has requests in flight at every checkpoint), and
  with scheduler.generation_batch=4 (results generated ahead in the checkpoint too),
  SIGTERM (a checkpoint at the current step, even with checkpoint.every=0; exit 143),
  a second run on a busy workdir (refused, exit 3; the first run is not disturbed),
  a corrupted newest checkpoint (detected, moved aside, the previous one resumed),
  non-finite updates (lr=1e30: skipped, then the run stops, exit 3; no NaN is ever saved).
  an over-long dataset row (dropped at load, named file:line, counted; no crash, no crash loop on
  resume),
  kill -9 of an async run with partial rollouts (rollout.partial="continue"): it resumes from its
  checkpoint, the buffer's per-token versions restored, and finishes (asynchronous, so not bit for
  bit: its requests in flight are generated again from their prompts).
Rewards that hang or eat memory are covered in test_rewards.py (the reward child's limits).
"""
import os
import shutil
import signal
import time

import chex
import json
import random
import pytest

from jaxreplay.infra import checkpoint as checkpoint_lib
from jaxreplay.learner import trainer
from tests.helpers.tiny_runs import SFT, comparable, read_rows, run_launch, start

pytestmark = pytest.mark.slow


def _wait_for(predicate, proc, timeout=300, what="the condition"):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def _has_checkpoint(workdir, step):
  return lambda: os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))


def _rows_reach(workdir, step):
  def check():
    try:
      return any(r["step"] >= step for r in read_rows(workdir))
    except (OSError, ValueError):
      return False
  return check


def _host_state(workdir, step):
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), create=False)
  try:
    state, host = ckpt.restore(step)
  finally:
    ckpt.close()
  return state, host


def _assert_same_end(workdir, reference, last=6):
  """Rows, final params, buffer, prompt cursor and the simulated clock equal the reference's."""
  rows, ref_rows = read_rows(workdir), read_rows(reference)
  assert [r["step"] for r in rows] == list(range(last + 1))  # no row lost or repeated
  assert [comparable(r) for r in rows] == [comparable(r) for r in ref_rows]
  state, host = _host_state(workdir, last)
  ref_state, ref_host = _host_state(reference, last)
  chex.assert_trees_all_equal(state["params"], ref_state["params"])  # restored as saved: dicts
  for key in ("prompts", "next_group_id", "sim", "scheduler"):
    assert repr(host[key]) == repr(ref_host[key]), key
  buf, ref_buf = host["buffer"], ref_host["buffer"]
  assert repr(buf) == repr(ref_buf)


def _saving_or_saved(workdir, step):
  """True once checkpoint `step`'s orbax tmp dir (a save in progress) or the step itself exists."""
  root = os.path.join(workdir, "checkpoints")
  def check():
    try:
      return any(n == str(step) or n.startswith(f"{step}.orbax-checkpoint-tmp")
                 for n in os.listdir(root))
    except FileNotFoundError:
      return False
  return check


def test_kill9_twice_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_reference_run):
  """Killed as soon as checkpoint 2 starts to be written (usually mid-save: the next run removes
  the unfinished tmp dir and starts over), then soon after checkpoint 4 is committed."""
  workdir = str(tmp_path / "killed")
  for wait_for in (_saving_or_saved(workdir, 2), _has_checkpoint(workdir, 4)):
    proc = start(workdir)
    deadline = time.monotonic() + 300
    while not wait_for() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # Under load the run may log steps 5-6 while checkpoint 4 is still being written: what matters is
  # that it resumes at 4 and rewrites those rows as the uninterrupted run has them.
  assert read_rows(workdir)[-1]["step"] >= 4
  out = run_launch(workdir)
  assert "resumed at step 4" in out.stderr
  _assert_same_end(workdir, tiny_reference_run)


def test_generation_batch_equals_one_request_per_call_and_resumes_after_kill9(
    tmp_path, tiny_reference_run):
  """scheduler.generation_batch=4 (each sampler call generates 3 requests ahead): every row equals
  the K = 1 reference's (each request gets the tokens it gets alone; the sampler's batches have
  the same shape either way, so bit for bit), plus sim/speculative_*; killed after checkpoint 4
  (of a 12-step run) and resumed (its results generated ahead restored), it ends as its uninterrupted run."""
  batched = ("--config.scheduler.generation_batch=4",)
  whole = str(tmp_path / "whole")
  run_launch(whole, *batched)
  rows = read_rows(whole)
  plain = lambda r: {k: v for k, v in comparable(r).items() if not k.startswith("sim/speculative")}
  assert [plain(r) for r in rows] == [plain(r) for r in read_rows(tiny_reference_run)]
  assert rows[-1]["sim/speculative_rows"] > 0 and "sim/speculative_rows" not in rows[0]
  # The kill: 12 steps, checkpoints every 4, killed once checkpoint 4 is committed (4 steps of
  # margin before checkpoint 8, however fast the machine), resumed, it ends as its whole run.
  longer = (*batched, "--config.total_steps=12", "--config.checkpoint.every=4")
  whole = str(tmp_path / "whole12")
  run_launch(whole, *longer)
  killed = str(tmp_path / "killed")
  proc = start(killed, *longer)
  _wait_for(_has_checkpoint(killed, 4), proc, what="checkpoint 4")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert read_rows(killed)[-1]["step"] < 8
  _, host = _host_state(killed, 4)
  assert host["scheduler"]["ahead"]  # results generated ahead were in the checkpoint
  out = run_launch(killed, *longer)
  assert "resumed at step 4" in out.stderr
  _assert_same_end(killed, whole, last=12)


def test_sigterm_saves_a_checkpoint_and_resumes_exactly(tmp_path, tiny_reference_run):
  workdir = str(tmp_path / "term")
  extra = ("--config.checkpoint.every=0", "--config.export_hf_every=4")  # no periodic checkpoints
  log = str(tmp_path / "term.log")
  proc = start(workdir, *extra, log_path=log)
  # Sent as soon as row 0 is written: before the first step ends (the workers are generating).
  _wait_for(_rows_reach(workdir, 0), proc, what="row 0")
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 128 + signal.SIGTERM
  text = open(log).read()
  assert "SIGTERM received: stopping after the current step" in text
  assert "rerun the same command to resume" in text and "Traceback" not in text
  stopped_at = read_rows(workdir)[-1]["step"]
  assert 1 <= stopped_at < 6  # a stop takes effect at a step's end
  assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(stopped_at)]
  assert open(os.path.join(workdir, ".lock")).read() == ""  # released
  out = run_launch(workdir, *extra)
  assert f"resumed at step {stopped_at}" in out.stderr
  _assert_same_end(workdir, tiny_reference_run)


def test_a_second_run_on_a_busy_workdir_is_refused(tmp_path):
  workdir = str(tmp_path / "busy")
  first = start(workdir, "--config.total_steps=60")
  try:
    _wait_for(_rows_reach(workdir, 0), first, what="the first run's step-0 row")
    config_before = open(os.path.join(workdir, "run_config.json")).read()
    out = run_launch(workdir, "--config.total_steps=7", expect_rc=3)
    assert f"is in use by pid {first.pid}" in out.stderr and "Traceback" not in out.stderr
    assert open(os.path.join(workdir, "run_config.json")).read() == config_before
    assert first.poll() is None  # the first run goes on
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  # (A lock left by a killed run is taken over: tests/infra/test_safety.py.)


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous(tmp_path, tiny_reference_run):
  workdir = str(tmp_path / "damaged")
  shutil.copytree(tiny_reference_run, workdir)
  newest = os.path.join(workdir, "checkpoints", "6")
  data = sorted((os.path.getsize(os.path.join(d, f)), os.path.join(d, f))
                for d, _, files in os.walk(os.path.join(newest, "state")) for f in files)[-1][1]
  with open(data, "r+b") as f:  # 8 bytes in the largest array file: silent corruption
    f.seek(os.path.getsize(data) // 2)
    f.write(b"\xff" * 8)
  out = run_launch(workdir)  # resumes from step 4: rows 5 and 6 are dropped and made again
  assert "checkpoint step 6 is damaged" in out.stderr and "resumed at step 4" in out.stderr
  assert os.path.isdir(os.path.join(workdir, "checkpoints.damaged", "6"))
  _assert_same_end(workdir, tiny_reference_run)


def test_nonfinite_updates_stop_the_run_and_nothing_nonfinite_is_saved(tmp_path):
  workdir = str(tmp_path / "nan")
  out = run_launch(workdir, "--config.trainer.learning_rate=1e30", "--config.total_steps=20",
                   "--config.trainer.max_nonfinite_skips=3", expect_rc=3)
  assert "NonFiniteUpdates" in out.stderr and "3 updates in a row had a non-finite" in out.stderr
  assert "learning rate" in out.stderr and "Traceback" not in out.stderr
  rows = read_rows(workdir)
  skipped = [r["step"] for r in rows if r.get("nonfinite_skipped")]
  assert len(skipped) >= 3 and skipped[-3:] == [rows[-1]["step"] - 2, rows[-1]["step"] - 1,
                                                rows[-1]["step"]]
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
  assert steps  # checkpoints were written (every 2 steps) ...
  for step in steps:  # ... and every one of them holds finite parameters
    state, _ = _host_state(workdir, step)
    assert trainer.all_finite(state["params"]), step


def test_an_over_long_dataset_row_is_dropped_not_crashed_on(tmp_path):
  """Before: the row crashed the run when first sampled, and every resume (the pending prompt is
  handed out first). Now it is dropped at load, named by file:line, and counted."""
  data = tmp_path / "train.jsonl"
  rng = random.Random(0)
  with open(data, "w") as f:
    for i in range(300):
      if i == 57:  # line 58: 161 tokens > model.max_len 32 - rollout.max_tokens 6
        f.write(json.dumps({"problem": "+".join(["1"] * 80) + "=", "answer": "80"}) + "\n")
      else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        f.write(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  workdir = str(tmp_path / "math")
  args = ("--config.task.name=math", f"--config.task.path={data}", "--config.task.template=plain",
          f"--config.model.path={SFT}", "--config.trainer.schedule=constant")
  out = run_launch(workdir, *args, "--config.total_steps=1")
  assert "dropped 1 of 284 training rows" in out.stderr and f"{data}:58 (161 tokens)" in out.stderr
  out = run_launch(workdir, *args, "--config.total_steps=3")  # a resume meets no dropped row
  assert "resumed at step 1" in out.stderr
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert all(r["data/skipped_rows"] == 1.0 for r in rows) and rows[-1]["reward/calls"] > 0


def test_async_partial_rollouts_killed_then_resumed(tmp_path):
  workdir = str(tmp_path / "partial")
  extra = ("--config.scheduler.kind=async", "--config.rollout.partial=continue",
           "--config.rollout.partial_chunk_tokens=2", "--config.buffer.max_staleness=3",
           "--config.rollout.prompts_in_flight=8", "--config.total_steps=8")
  proc = start(workdir, *extra)
  _wait_for(_has_checkpoint(workdir, 4), proc, timeout=600, what="checkpoint 4")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  before = read_rows(workdir)
  assert before[-1]["step"] < 8
  _, host = _host_state(workdir, 4)
  buf = host["buffer"]
  if "token_versions" in buf:  # rollouts continued across a refresh were held: versions per token
    assert len(buf["token_versions"]) == len(buf["completion_tokens"])
  out = run_launch(workdir, *extra, timeout=900)
  assert "resumed at step 4" in out.stderr
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == list(range(9))  # no row lost or repeated
  last = rows[-1]
  for key in ("rollout/partial_continued", "rollout/versions_per_rollout_mean",
              "buffer/token_staleness_mean", "buffer/stale_dropped", "time/trainer_wait_s",
              "batch/stale_masked_fraction"):
    assert key in last, key
  # counters continue over the resume; refreshes reached requests in flight
  assert last["rollout/partial_continued"] >= max(r.get("rollout/partial_continued", 0)
                                                  for r in before) and (
      last["rollout/partial_continued"] > 0)
  # max_staleness 3: a batch's tokens more than 3 versions old were masked out of it
  assert all(r["buffer/token_staleness_max"] <= 3 or r["batch/stale_masked_fraction"] > 0
             for r in rows if "buffer/token_staleness_max" in r)
  assert last["mismatch/exp_abs_diff"] <= 1.05  # fresh tokens: sampler == trainer at one version
