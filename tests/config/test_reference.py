"""The config keys' meanings: one per key, parsed from defaults.py's comments; the reference page
generated from them is the committed one."""
import os
import subprocess
import sys

from jaxreplay.config import defaults
from jaxreplay.config import reference
from tests.helpers.paths import REPO


def test_every_key_and_section_has_a_meaning():
  assert reference.missing_descriptions() == []
  known = reference.descriptions()
  leaves = [k for k, _ in reference.flat_items(defaults.base_config())]
  sections = {k.rsplit(".", 1)[0] for k in leaves if "." in k}
  assert set(known) == set(leaves) | sections  # nothing parsed that is not a key
  assert all(len(text) > 10 and "\n" not in text for text in known.values())


def test_meanings_join_the_comment_lines_under_a_key():
  known = reference.descriptions()
  assert known["buffer.size"] == "N, in rollouts"
  assert known["model.lora_targets"] == "the linear kernels that get an adapter (HF module names)"
  assert known["total_steps"] == ("gradient steps (= policy versions produced); a cap when "
                                  "compute_budget is set")
  assert known["trainer.logprob_remat"].endswith("never (keeps [B, T, V] logits); same values")
  assert reference.notes()["scheduler.mu"].startswith("Virtual costs (simulated, sync)")


def test_a_key_without_a_comment_is_reported():
  c = defaults.base_config()
  c.trainer.new_key = 3
  assert reference.missing_descriptions(c) == ["trainer.new_key"]


def test_format_config_lists_each_key_with_value_and_meaning():
  c = defaults.base_config()
  c.buffer.size = 300
  text = reference.format_config(c)
  lines = [line for line in text.splitlines() if " = " in line]
  assert len(lines) == len(reference.flat_items(c))
  assert any(line.startswith("buffer.size = 300 ") and line.endswith("# N, in rollouts")
             for line in lines)
  assert "[buffer]  the replay buffer" in text
  order = [line.split(" = ")[0] for line in lines]
  assert order.index("seed") < order.index("model.preset") < order.index("log.every_s")


def test_the_committed_reference_page_is_current(tmp_path):
  with open(os.path.join(REPO, reference.PAGE), encoding="utf-8") as f:
    assert f.read() == reference.markdown(), f"regenerate it: {reference.COMMAND}"
  page = reference.markdown()
  assert "| `buffer.size` | `84` | N, in rollouts |" in page
  assert "## `trainer`" in page and "data\\*fsdp\\*this" in page  # '*' escaped in cells
  stale = tmp_path / "configuration.md"
  stale.write_text("old\n")
  cmd = [sys.executable, "-m", "jaxreplay.config.reference", f"--out={stale}"]
  check = subprocess.run(cmd + ["--check"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert check.returncode == 1 and "is not current; regenerate it" in check.stderr
  write = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert write.returncode == 0 and stale.read_text() == page
  assert subprocess.run(cmd + ["--check"], cwd=REPO, timeout=120).returncode == 0
