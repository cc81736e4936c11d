"""Every off-policy option of issue 27 runs end to end in the tiny default (a few steps of
`configs/tiny.py` through `python -m jaxreplay.launch`, as `tiny_runs` launches them) and logs its
masked / truncated fraction or its buffer metric."""
import math
import signal
import time

import pytest

from tests.helpers import tiny_runs


pytestmark = pytest.mark.slow

FEW = ("--config.total_steps=3", "--config.eval.every=0", "--config.checkpoint.every=3")

# (overrides, the metric keys each training row must carry). The corrections exclude each other,
# the samplers combine with them and with each other, so each run pairs a correction with a
# sampler: every option runs, in 7 launches rather than 11.
OPTIONS = {
    "tis+priority_fresh": (("--config.trainer.off_policy=tis", "--config.buffer.priority=fresh",
                            "--config.buffer.fresh_tau=2.0"),
                           ("tis_truncated_fraction", "buffer/staleness_mean")),
    "tis_cap+max_uses": (("--config.trainer.tis_cap=2.0", "--config.buffer.max_uses=1"),
                         ("tis_truncated_fraction", "buffer/retired")),
    "mis_sequence+replace_zero_variance": (
        ("--config.trainer.off_policy=mis_sequence", "--config.buffer.replace_zero_variance=True"),
        ("mis_masked_fraction", "mis_masked_sequence_fraction", "buffer/zero_variance_fraction",
         "buffer/batch_zero_variance_fraction")),
    "m2po": (("--config.trainer.off_policy=m2po",), ("m2po_masked_fraction", "m2po_second_moment")),
    "decoupled": (("--config.trainer.off_policy=decoupled",), ("decoupled_masked_fraction",)),
    "asymre_mis_token": (("--config.trainer.loss=asymre", "--config.trainer.off_policy=mis_token"),
                         ("mis_masked_fraction",)),
    "top_p_processed": (("--config.rollout.top_p=0.9", "--config.rollout.temperature=0.9",
                         "--config.trainer.off_policy=mis_token"), ("mis_masked_fraction",)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_runs_in_the_tiny_default(tmp_path, name):
  overrides, keys = OPTIONS[name]
  tiny_runs.run_launch(str(tmp_path / name), *FEW, *overrides)
  rows = [r for r in tiny_runs.read_rows(str(tmp_path / name)) if "loss" in r]
  assert len(rows) == 3
  for row in rows:
    assert math.isfinite(row["loss"]) and row["nonfinite_skipped"] == 0.0
    for key in keys:
      assert key in row, (key, sorted(row))
      if key.endswith("fraction"):
        assert 0.0 <= row[key] <= 1.0, (key, row[key])


def test_corrections_and_samplers_resume_exactly(tmp_path):
  """A run with the samplers and a correction on, stopped by SIGTERM after its first steps and
  resumed, writes the rows of an uninterrupted run (the buffer's retired count, group reward
  ranges and draws continue from its checkpoint)."""
  opts = ("--config.buffer.priority=fresh", "--config.buffer.max_uses=2",
          "--config.buffer.replace_zero_variance=True", "--config.trainer.off_policy=m2po",
          "--config.checkpoint.every=0")
  ref, work = str(tmp_path / "ref"), str(tmp_path / "term")
  tiny_runs.run_launch(ref, *opts)
  proc = tiny_runs.start(work, *opts)
  deadline = time.monotonic() + 300
  while not any(r["step"] >= 2 for r in _rows(work)):
    assert proc.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 128 + signal.SIGTERM
  stopped_at = tiny_runs.read_rows(work)[-1]["step"]
  assert 2 <= stopped_at < 6
  tiny_runs.run_launch(work, *opts)
  rows, ref_rows = tiny_runs.read_rows(work), tiny_runs.read_rows(ref)
  assert [r["step"] for r in rows] == list(range(7))
  assert [tiny_runs.comparable(r) for r in rows] == [tiny_runs.comparable(r) for r in ref_rows]
  assert rows[-1]["buffer/retired"] > 0


def _rows(workdir):
  try:
    return tiny_runs.read_rows(workdir)
  except (OSError, ValueError):
    return []
