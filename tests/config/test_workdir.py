"""The run directory checked before anything is written."""
import json
import os

from jaxreplay.config import defaults
from jaxreplay.config import workdir


def test_workdir_errors(tmp_path):
  assert workdir.workdir_errors(str(tmp_path)) == []
  assert workdir.workdir_errors(str(tmp_path / "new" / "run")) == []
  (tmp_path / "file").write_text("x")
  assert "is a file, not a directory" in workdir.workdir_errors(str(tmp_path / "file"))[0]
  assert "which is a file" in workdir.workdir_errors(str(tmp_path / "file" / "run"))[0]
  os.chmod(tmp_path / "file", 0o644)
  locked = tmp_path / "ro"
  locked.mkdir()
  os.chmod(locked, 0o500)
  try:
    if not os.access(locked, os.W_OK):  # root writes anywhere
      assert "is not writable" in workdir.workdir_errors(str(locked))[0]
  finally:
    os.chmod(locked, 0o700)


def test_resume_errors(tmp_path):
  c = defaults.base_config()
  c.trainer.schedule = "cosine"
  assert workdir.resume_errors(c, str(tmp_path)) == []  # nothing to resume
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  (tmp_path / "run_config.json").write_text(json.dumps(c.to_dict()))
  assert workdir.resume_errors(c, str(tmp_path)) == []
  longer = c.copy_and_resolve_references()
  longer.total_steps = 200
  assert "changed cosine schedule (total_steps 100 -> 200)" in workdir.resume_errors(
      longer, str(tmp_path))[0]
  lora = c.copy_and_resolve_references()
  lora.model.lora_rank = 8
  assert "changed LoRA settings (model.lora_rank 0 -> 8)" in workdir.resume_errors(
      lora, str(tmp_path))[0]
