"""Tests of the metric writers (JSONL, TensorBoard, W&B offline) and the progress line."""
import glob
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.infra import metric_writers
from tests.helpers.paths import REPO

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")


def read_tb_scalars(tb_dir):
  """{tag: [(step, value)]} from the TFRecord event files (length, crc, payload, crc)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
  with metric_writers.MetricsWriter(str(tmp_path)) as w:
    row = w.write(np.int64(1), {"loss": np.float32(0.5), "reward_mean": jnp.asarray(0.25),
                                "count": np.int32(3), "flag": np.bool_(True), "name": "x",
                                "bad": float("nan"), "vec": np.arange(2)})
    w.write(2, {"loss": 0.4})
  assert row == {"step": 1, "loss": 0.5, "reward_mean": 0.25, "count": 3, "flag": True,
                 "name": "x", "bad": row["bad"], "vec": [0, 1]}
  assert type(row["reward_mean"]) is float and type(row["count"]) is int
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert json.loads(lines[0])["bad"] is None  # strict JSON: nan -> null
  assert "NaN" not in lines[0]
  assert [json.loads(l)["step"] for l in lines] == [1, 2]
  scalars = read_tb_scalars(str(tmp_path / "tb"))
  assert scalars["loss"] == [(1, 0.5), (2, pytest.approx(0.4))]
  assert scalars["reward_mean"] == [(1, 0.25)]
  assert scalars["count"] == [(1, 3.0)]
  assert "name" not in scalars and "flag" not in scalars


def test_truncate_after_resume(tmp_path):
  w = metric_writers.MetricsWriter(str(tmp_path), tensorboard=False)
  for s in range(1, 6):
    w.write(s, {"v": float(s)})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "v": 6.0')  # a line cut by a crash
  w = metric_writers.MetricsWriter(str(tmp_path), resume_step=3)  # resuming from the step-3 checkpoint
  w.write(4, {"v": 40.0})
  assert w.truncate_after(10) == 4
  w.write(5, {"v": 50.0})
  w.close()
  rows = metric_writers.read_metrics(str(tmp_path))
  assert [(r["step"], r["v"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
  with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
    metric_writers.read_metrics(str(tmp_path / "nope"))


def test_progress_logger_rate_and_eta():
  now = [100.0]
  p = metric_writers.ProgressLogger(total_steps=110, every_s=30, start_step=10, clock=lambda: now[0],
                                    keys=("reward_mean", "loss"))
  now[0] = 110.0
  # The first update's time includes start-up and compilation: no rate from it, no line.
  assert p.update(20, {"reward_mean": np.float32(0.5), "other": 1.0}) is None
  now[0] = 120.0
  first = p.update(30, {"loss": 2.0})  # the second update prints at once, with an ETA
  assert "step 30/110" in first and "1 steps/s" in first and "ETA 1m20s" in first
  assert "reward_mean=0.5" in first and "loss=2" in first and "other" not in first
  now[0] = 130.0
  assert p.update(40) is None  # 10 s < every_s
  now[0] = 160.0
  line = p.update(60, {"loss": 3.0})  # 40 steps in the 50 s since the first update
  assert "step 60/110 (54.5%)" in line and "0.8 steps/s" in line and "ETA 1m02s" in line
  assert "loss=3" in line
  assert p.update(110) is not None  # the last step always logs
  single = metric_writers.ProgressLogger(total_steps=5, every_s=30)
  assert single.update(5) is not None  # a run's only update is its last: it logs
  assert metric_writers.format_duration(3723) == "1h02m03s"
  assert metric_writers.format_duration(float("inf")) == "?"


def test_progress_logger_evaluation_line():
  p = metric_writers.ProgressLogger(total_steps=10)
  line = p.evaluated(0, {"eval/pass@16": 0.98, "eval/pass@1": np.float32(0.5625),
                         "eval/pass@2": 0.7, "eval/entropy": 0.28, "eval/seconds": 65.0,
                         "eval/num_samples": 16.0})
  assert line == ("eval at step 0: pass@1 0.562 | entropy 0.280 | pass@2 0.700 | pass@16 0.980 "
                  "(1m05s)")


def test_tensorboard_skips_nonfinite_and_sanitises_names(tmp_path):
  with metric_writers.MetricsWriter(str(tmp_path)) as w:
    w.write(1, {"reward_mean": float("nan"), "eval/pass@1": 0.5, "loss": float("inf")})
    w.write(2, {"reward_mean": 0.25, "eval/pass@1": 0.75, "loss": 1.0})
  rows = metric_writers.read_metrics(str(tmp_path))
  assert rows[0]["reward_mean"] is None and rows[0]["loss"] is None  # JSONL keeps the row, as null
  scalars = read_tb_scalars(str(tmp_path / "tb"))
  assert set(scalars) == {"reward_mean", "eval/pass_1", "loss"}
  assert scalars["reward_mean"] == [(2, 0.25)] and scalars["loss"] == [(2, 1.0)]
  assert scalars["eval/pass_1"] == [(1, 0.5), (2, 0.75)]
  assert metric_writers.tensorboard_name("a b/c@1:x") == "a_b/c_1_x"


# ---- Weights & Biases ----------------------------------------------------------------------------

def read_wandb_records(run_file):
  """The protobuf records of an offline run's `run-*.wandb` file: a 7-byte header (":W&B", magic,
  version), then LevelDB-log records (crc u32, length u16, type u8: 1 full, 2 first, 3 middle,
  4 last) in 32 KiB blocks, each payload a `wandb_internal_pb2.Record`."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data = open(run_file, "rb").read()
  assert data[:4] == b":W&B", f"{run_file} is not a W&B transaction log"
  block, pos, records, buf = 32768, 7, [], b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is zero filler
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if pos + 7 + length > len(data):  # a record still being written
      break
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == 0:
      continue
    buf = chunk if kind in (1, 2) else buf + chunk
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(buf))
  return records


def _wandb_history(run_file, timeout_s=60.0):
  """(history rows without wandb's "_" keys, the run record) of a finished offline run. wandb's
  service may still be writing the file when `finish()` returns: wait for its exit record."""
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  records = read_wandb_records(run_file)
  while not any(r.WhichOneof("record_type") == "exit" for r in records):
    assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout_s} s"
    time.sleep(0.5)
    records = read_wandb_records(run_file)
  rows, run = [], None
  for r in records:
    kind = r.WhichOneof("record_type")
    if kind == "history":
      row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
      rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    elif kind == "run":
      run = r.run
  return rows, run


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
  from tests.helpers.deps import require  # pylint: disable=g-import-not-at-top
  require("wandb")
  for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  return tmp_path / "run"


def test_wandb_offline_run_gets_the_rows_and_config(wandb_offline):
  workdir = str(wandb_offline)
  config = {"trainer": {"learning_rate": 1e-4, "buckets": [16, 32]}, "seed": 3}
  settings = metric_writers.WandbSettings(project="jaxreplay-test", mode="offline", run_name="tiny-run",
                                          config=config)
  with metric_writers.MetricsWriter(workdir, wandb=settings) as w:
    written = [w.write(0, {"loss": 0.5, "eval/pass@1": 0.25, "name": "x", "bad": float("nan")}),
               w.write(1, {"loss": np.float32(0.25), "count": np.int32(3)}),
               w.write(2, {"loss": 0.125, "eval/pass@1": 0.5})]
  run_files = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(run_files) == 1
  history, run = _wandb_history(run_files[0])
  # Exactly the finite numbers of each JSONL row, "step" included; the JSONL keeps its keys.
  assert history == [{k: v for k, v in row.items() if k not in ("name", "bad")} for row in written]
  assert [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))] == [
      0, 1, 2]
  assert run.project == "jaxreplay-test" and run.display_name == "tiny-run"
  logged = {i.key: json.loads(i.value_json) for i in run.config.update}
  assert logged["trainer"] == config["trainer"] and logged["seed"] == 3
  run_id = open(os.path.join(workdir, metric_writers.WANDB_RUN_ID_FILE)).read().strip()
  assert run.run_id == run_id and run_files[0].endswith(f"run-{run_id}.wandb")

  # A resumed writer continues the same W&B run; a fresh one starts another.
  with metric_writers.MetricsWriter(workdir, resume_step=1, wandb=settings) as w:
    w.write(2, {"loss": 0.0625})
  assert open(os.path.join(workdir, metric_writers.WANDB_RUN_ID_FILE)).read().strip() == run_id
  with metric_writers.MetricsWriter(workdir, wandb=settings) as w:
    w.write(0, {"loss": 1.0})
  assert open(os.path.join(workdir, metric_writers.WANDB_RUN_ID_FILE)).read().strip() != run_id


def test_wandb_settings_from_config_and_errors():
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.base_config()
  assert (metric_writers.wandb_settings(c.log) is None
          and metric_writers.wandb_config_errors(c.log) == [])
  c.log.wandb_project, c.log.wandb_mode, c.log.wandb_run_name = "p", "offline", "r"
  s = metric_writers.wandb_settings(c.log, c.to_dict())
  assert (s.project, s.mode, s.run_name, s.entity) == ("p", "offline", "r", "")
  assert s.config["trainer"]["loss"] == c.trainer.loss
  c.log.wandb_mode = "cloud"
  assert any("log.wandb_mode='cloud'" in e for e in metric_writers.wandb_config_errors(c.log))
  with pytest.raises(ValueError, match="log.wandb_mode"):
    metric_writers.wandb_settings(c.log)


def test_default_writer_never_imports_wandb(tmp_path):
  """With W&B off (the default) nothing imports wandb: no import cost, no warnings from it."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys; from jaxreplay.config import defaults; "
          "from jaxreplay.infra import metric_writers; from jaxreplay.run import build; "
          f"w = metric_writers.MetricsWriter({str(tmp_path)!r}, "
          "wandb=metric_writers.wandb_settings(defaults.base_config().log)); "
          "w.write(0, {'loss': 1.0}); w.close(); assert 'wandb' not in sys.modules, 'imported'")
  env = {**os.environ, "PYTHONPATH": REPO}
  subprocess.run([sys.executable, "-W", "error::DeprecationWarning:jaxreplay", "-c", code],
                 check=True, env=env, timeout=300)
