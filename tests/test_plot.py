"""`python -m jaxreplay.plot`: metric vs compute per run, grouped seeds (median and IQR), labels."""
import glob
import os

import numpy as np
import pytest

from jaxreplay import plot
from jaxreplay.infra import metric_writers


def _write_run(path, xs, ys, key="eval/pass@1"):
  os.makedirs(path, exist_ok=True)
  with metric_writers.MetricsWriter(str(path), tensorboard=False) as w:
    for i, (x, y) in enumerate(zip(xs, ys)):
      w.write(i, {"compute_seconds": x, key: y, "reward_mean": y / 2})
      w.write(i, {"compute_seconds": x, "loss": 1.0})  # a row without the y metric


def test_plot_runs_one_line_per_run(tmp_path):
  _write_run(tmp_path / "replay", [0, 1, 2, 3], [0.1, 0.2, 0.4, 0.5])
  _write_run(tmp_path / "onpolicy", [0, 2, 4], [0.1, 0.15, 0.3])
  out = tmp_path / "fig" / "fig.png"
  drawn = plot.plot_runs([str(tmp_path / "replay"), str(tmp_path / "onpolicy")], str(out),
                         ys=("eval/pass@1", "reward_mean"))
  data = out.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
  np.testing.assert_allclose(drawn["eval/pass@1"]["replay"]["x"], [0, 1, 2, 3])
  np.testing.assert_allclose(drawn["eval/pass@1"]["replay"]["median"], [0.1, 0.2, 0.4, 0.5])
  np.testing.assert_allclose(drawn["reward_mean"]["onpolicy"]["median"], [0.05, 0.075, 0.15])
  # The noisy per-step reward gets a smoothed line (bias-corrected EMA: starts at the first value)
  assert drawn["reward_mean"]["onpolicy"]["smoothed"][0] == pytest.approx(0.05)
  assert "smoothed" not in drawn["eval/pass@1"]["replay"]


def test_plot_labels_titles_and_smoothed_line(tmp_path, monkeypatch):
  """Axis labels in words with units, a title per panel and figure, an EMA over the faint raw
  per-step reward points (named in the legend)."""
  from matplotlib.figure import Figure
  figs = []
  monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figs.append(self))
  rng = np.random.default_rng(0)
  ys = np.clip(np.linspace(0.1, 0.6, 60) + rng.normal(0, 0.1, 60), 0, 1)
  _write_run(tmp_path / "a" / "seed0", np.arange(60) * 10.0, ys)
  _write_run(tmp_path / "b" / "seed0", np.arange(60) * 10.0, ys[::-1])
  with open(tmp_path / "a" / "seed0" / "run_config.json", "w") as f:
    f.write('{"eval": {"temperature_pass1": 0.1, "temperature_passk": 1.0}}')
  drawn = plot.plot_runs([str(tmp_path / "a" / "seed0"), str(tmp_path / "b" / "seed0")],
                         str(tmp_path / "f.png"), ys=("eval/pass@1", "reward_mean"))
  assert set(drawn["reward_mean"]) == {"a/seed0", "b/seed0"}  # same basename: parents tell apart
  (fig,) = figs
  assert fig.get_suptitle()
  ax_pass, ax_reward = fig.axes
  assert ax_pass.get_xlabel() == "compute (device-seconds)"
  assert ax_pass.get_ylabel() == "held-out pass@1 (T=0.1)"
  assert ax_reward.get_ylabel() == "reward (mean over the batch)"
  assert plot.axis_label("step") == "training step"
  for ax in (ax_pass, ax_reward):
    assert ax.get_title()
  lines = ax_reward.get_lines()
  raw = [l for l in lines if l.get_linestyle() == "None"]
  smooth = [l for l in lines if l.get_linestyle() != "None"]
  assert len(raw) == len(smooth) == 2
  assert all(l.get_alpha() is not None and l.get_alpha() < 0.5 for l in raw)
  assert all("EMA" in l.get_label() for l in smooth)
  sm = smooth[0].get_ydata()
  np.testing.assert_allclose(sm, plot.ema(ys / 2))
  assert np.std(np.diff(sm)) < 0.5 * np.std(np.diff(ys / 2))  # smoother than the raw points
  assert all(l.get_label().startswith(("a/seed0", "b/seed0")) for l in ax_pass.get_lines())


def test_plot_groups_median_and_iqr(tmp_path):
  rng = np.random.default_rng(0)
  finals = []
  for seed in range(4):
    ys = np.linspace(0, 1, 6) * rng.uniform(0.5, 1.0)
    finals.append(ys[-1])
    _write_run(tmp_path / f"replay_s{seed}", np.linspace(0, 10 + seed, 6), ys)
  _write_run(tmp_path / "onpolicy_s0", np.linspace(0, 10, 6), np.zeros(6))
  out = tmp_path / "g.png"
  assert plot.main(["--runs", str(tmp_path / "*_s*"), "--group", r"(.*)_s\d+",
                    "--out", str(out)]) == 0
  assert out.stat().st_size > 5000
  drawn = plot.plot_runs(sorted(glob.glob(str(tmp_path / "*_s*"))), str(out), group=r"(.*)_s\d+")
  assert set(drawn["eval/pass@1"]) == {"replay", "onpolicy"}
  rep = drawn["eval/pass@1"]["replay"]
  assert rep["x"][0] == 0 and rep["x"][-1] == 10  # the overlap of the four runs' x ranges
  at10 = [f * 10 / (10 + s) for s, f in enumerate(finals)]  # each run interpolated at x = 10
  assert rep["median"][-1] == pytest.approx(np.median(at10))
  assert rep["q25"][-1] == pytest.approx(np.percentile(at10, 25))
  assert rep["q75"][-1] == pytest.approx(np.percentile(at10, 75))
  with pytest.raises(ValueError, match="does not match"):
    plot.plot_runs([str(tmp_path / "onpolicy_s0")], str(out), group=r"seed(\d+)")
  with pytest.raises(ValueError, match="no run has rows"):
    plot.plot_runs([str(tmp_path / "onpolicy_s0")], str(out), ys=("missing",))
  with pytest.raises(FileNotFoundError):
    plot.main(["--runs", str(tmp_path / "absent"), "--out", str(out)])
