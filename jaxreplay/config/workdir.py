"""The run directory checked against a config before anything is written in it.

  `workdir_errors(path)`         a file where the directory should be, a parent that is a file or
                                 cannot be written
  `resume_errors(config, path)`  rerunning a workdir whose checkpoints were written with settings
                                 that would silently change the training: a cosine schedule's
                                 horizon (the learning rate would jump), LoRA turned on or off or
                                 reshaped (the checkpoint holds the other kind of train state)

Both read only (run_config.json of the earlier run); `python -m jaxreplay.launch` runs them with the
config's validation, before the workdir or its lock is created.
"""
from __future__ import annotations

import json
import os

LORA_KEYS = ("lora_rank", "lora_targets", "lora_alpha", "lora_rslora", "lora_dtype")


def workdir_errors(path: str) -> list[str]:
  """What stops `path` from being (or becoming) a run directory, each with its fix."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(path):
    return [] if os.access(path, os.W_OK | os.X_OK) else [
        f"--workdir={path} is not writable by this user; choose another --workdir"]
  if os.path.exists(path):
    return [f"--workdir={path} is a file, not a directory; choose another --workdir (or move the "
            "file away)"]
  parent = os.path.dirname(path)
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if parent and not os.path.isdir(parent):
    return [f"--workdir={path} lies under {parent}, which is a file; choose another --workdir"]
  if parent and not os.access(parent, os.W_OK | os.X_OK):
    return [f"--workdir={path} cannot be created: {parent} is not writable by this user; choose "
            "another --workdir"]
  return []


def _plain(value):
  """A config value as run_config.json holds it (tuples as lists)."""
  return list(value) if isinstance(value, (tuple, list)) else value


def resume_errors(config, workdir: str) -> list[str]:
  """Changes between the run that wrote `workdir` (its run_config.json, once it has a committed
  checkpoint) and `config` that would silently change the training (see the module docstring)."""
  path = os.path.join(workdir, "run_config.json")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  committed = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
  if not committed or not os.path.isfile(path):  # nothing to resume: any horizon is fine
    return []
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    return []
  old_m = old.get("model", {})
  lora_changed = [f"model.{k} {old_m.get(k)} -> {config.model.get(k)}" for k in LORA_KEYS
                  if k in old_m and _plain(old_m[k]) != _plain(config.model.get(k))]
  if lora_changed:
    return [f"resuming {workdir} with changed LoRA settings ({', '.join(lora_changed)}): its "
            "checkpoints hold the other train state; resume with the original values, or start a "
            "new workdir"]
  t, old_t = config.trainer, old.get("trainer", {})
  if t.schedule != "cosine" or old_t.get("schedule") != "cosine":
    return []
  changed = [f"{name} {old_v} -> {new_v}" for name, old_v, new_v in (
      ("total_steps", old.get("total_steps"), config.total_steps),
      ("trainer.warmup_steps", old_t.get("warmup_steps"), t.warmup_steps)) if old_v != new_v]
  if changed:
    return [f"resuming {workdir} with a changed cosine schedule ({', '.join(changed)}): the "
            "learning rate would jump at the resumed step; resume with the original values, or "
            "start a new workdir (or use trainer.schedule='constant', which has no horizon)"]
  return []
