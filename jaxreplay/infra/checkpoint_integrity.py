"""Integrity of checkpoint step directories: a sha256 manifest per step, verification, tmp cleanup.

orbax commits a step atomically (it writes `<dir>/<step>.orbax-checkpoint-tmp`, then renames it to
`<dir>/<step>`), but it does not notice bytes changed or cut off on disk later: 8 overwritten bytes
in a data file restore silently. So `Checkpointer` writes `MANIFEST.sha256.json` into the step's
temporary directory from orbax's post-finalization hook (`AsyncOptions.post_finalization_callback`:
after every item is written and finalised, before the commit rename), so a step becomes visible with
its manifest or not at all. The manifest maps every file's path (relative to the step directory, '/'
separated) to its size (bytes) and sha256 (hex).

Two files orbax writes at the commit itself, after the hook, cannot be hashed:
`_CHECKPOINT_METADATA` (it gets its commit timestamp) is checked to parse as a JSON object instead;
`commit_success.txt` (a marker whose text names the final path) is not checked.

Cost: sha256 runs at ~1.1 GB/s per core (measured: 1130-1160 MB/s in 1-8 MiB chunks, 975 MB/s with
`hashlib.file_digest` from the page cache; OpenSSL with SHA-NI on an AMD EPYC, 2 busy cores). Files
are hashed on up to `_HASH_THREADS` threads (hashlib releases the GIL), so a 100 GB train state (8B
params + Adam moments in f32) takes ~1.5 min on 8 cores plus the disk reads: on save this is in
orbax's background thread (it delays the commit, not the train step); on restore it is an extra
full read of the step before orbax reads it.

A step without a manifest is either from before manifests existed (restorable; `verify_step_dir`
logs a note and reports no problem) or lost its manifest (a problem): the two are told apart by the
`custom_metadata` of the step's `_CHECKPOINT_METADATA`, which records `MANIFEST_KEY` when the save
wrote a manifest (`save_metadata()`).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
from typing import Optional

from absl import logging

MANIFEST_NAME = "MANIFEST.sha256.json"
MANIFEST_KEY = "jaxreplay_manifest"  # in a step's custom_metadata: the save wrote a manifest
MANIFEST_FORMAT = 1

# Written by orbax when it commits the step (after the post-finalization hook): not hashable.
STEP_METADATA = "_CHECKPOINT_METADATA"  # JSON, updated with the commit timestamp: must parse
COMMIT_MARKER = "commit_success.txt"    # text naming the final path: not checked
_UNHASHED = (STEP_METADATA, COMMIT_MARKER)

# orbax's temporary step directories: `<step>.orbax-checkpoint-tmp` (orbax 0.12; older versions
# appended `-<timestamp>`), see orbax.checkpoint._src.path.atomicity_types.TMP_DIR_SUFFIX.
TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
_TMP_DIR_RE = re.compile(r"^\d+" + re.escape(TMP_DIR_SUFFIX) + r"(-.*)?$")

_CHUNK = 8 << 20      # bytes per read
_HASH_THREADS = 8
_MAX_PROBLEMS = 8     # problems listed per step; the rest are counted


def sha256_file(path: str) -> tuple[str, int]:
  """(hex sha256, size in bytes) of the file at `path`, read in 8 MiB chunks."""
  h = hashlib.sha256()
  size = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
      size += len(chunk)
  return h.hexdigest(), size


def _files(step_dir: str) -> list[str]:
  """Relative '/'-separated paths of the regular files under `step_dir`, sorted."""
  out = []
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      out.append(rel.replace(os.sep, "/"))
  return sorted(out)


def _hash_all(step_dir: str, rel_paths: list[str]) -> dict[str, tuple[str, int]]:
  """rel path -> (sha256, size); a file that cannot be read maps to its OSError instead."""
  def one(rel):
    try:
      return sha256_file(os.path.join(step_dir, rel))
    except OSError as e:
      return e
  threads = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(rel_paths)))
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return dict(zip(rel_paths, pool.map(one, rel_paths)))


def save_metadata() -> dict:
  """The `custom_metadata` a save passes to orbax: records that the step carries a manifest."""
  return {MANIFEST_KEY: MANIFEST_NAME}


def write_manifest(step_dir: str) -> dict:
  """Hashes every file of `step_dir` and writes `MANIFEST_NAME` there (atomically); returns it.

  Call only on a finalised step (every item on disk), before or after orbax's commit rename.
  Raises OSError (e.g. ENOSPC) when a file cannot be read or the manifest cannot be written.
  """
  rel_paths = [p for p in _files(step_dir) if p not in _UNHASHED and p != MANIFEST_NAME]
  files = {}
  for rel, got in _hash_all(step_dir, rel_paths).items():
    if isinstance(got, OSError):
      raise got
    files[rel] = {"sha256": got[0], "size": got[1]}
  manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files,
              "unhashed": list(_UNHASHED)}
  path = os.path.join(step_dir, MANIFEST_NAME)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return manifest


def _read_json(path: str) -> tuple[Optional[dict], Optional[str]]:
  """(object, None) or (None, why not) for the JSON object file at `path`."""
  try:
    with open(path, "rb") as f:
      obj = json.loads(f.read().decode("utf-8"))
  except FileNotFoundError:
    return None, "missing"
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    return None, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
  if not isinstance(obj, dict):
    return None, f"not a JSON object (a {type(obj).__name__})"
  return obj, None


def expects_manifest(step_dir: str) -> bool:
  """Whether the save of `step_dir` wrote a manifest (its step metadata says so)."""
  meta, _ = _read_json(os.path.join(step_dir, STEP_METADATA))
  custom = (meta or {}).get("custom_metadata")
  return isinstance(custom, dict) and custom.get(MANIFEST_KEY) == MANIFEST_NAME


def verify_step_dir(path: str) -> list[str]:
  """Problems of the checkpoint step directory `path` against its manifest; [] when it is intact.

  Each problem is one short line naming a file: missing, size differs (bytes), sha256 differs,
  unreadable manifest or step metadata, manifest missing although the save wrote one. At most
  `_MAX_PROBLEMS` are listed (then "... and N more"). Files not in the manifest are logged, not
  reported (they do not stop a restore). A step saved before manifests existed has no problem: a
  note is logged and only orbax's own checks apply to it.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    return [f"{path} is not a directory"]
  manifest, why = _read_json(os.path.join(path, MANIFEST_NAME))
  if manifest is None:
    if why == "missing" and not expects_manifest(path):
      logging.info("checkpoint %s has no %s (saved before manifests existed); restoring it "
                   "unverified", path, MANIFEST_NAME)
      return []
    return [f"{MANIFEST_NAME} {why}" + (" although the save wrote one" if why == "missing" else "")]
  files = manifest.get("files")
  if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
    return [f"{MANIFEST_NAME} is malformed (no sha256 'files' table)"]

  problems = []
  if STEP_METADATA in manifest.get("unhashed", ()):
    _, why = _read_json(os.path.join(path, STEP_METADATA))
    if why is not None:
      problems.append(f"{STEP_METADATA} {why}")
  present = set(_files(path))
  listed = [rel for rel in sorted(files) if rel in present]
  problems += [f"{rel} missing" for rel in sorted(files) if rel not in present]
  for rel, got in _hash_all(path, listed).items():
    want = files[rel]
    if isinstance(got, OSError):
      problems.append(f"{rel} unreadable ({got.strerror or got})")
    elif got[1] != want.get("size"):
      problems.append(f"{rel} has {got[1]} bytes, the manifest says {want.get('size')}")
    elif got[0] != want.get("sha256"):
      problems.append(f"{rel} sha256 differs from the manifest (content changed)")
  extra = sorted(present - set(files) - set(_UNHASHED) - {MANIFEST_NAME})
  if extra:
    logging.info("checkpoint %s holds %d file(s) its manifest does not list (ignored): %s",
                 path, len(extra), ", ".join(extra[:5]))
  if len(problems) > _MAX_PROBLEMS:
    problems = problems[:_MAX_PROBLEMS] + [f"... and {len(problems) - _MAX_PROBLEMS} more"]
  return problems


def stale_tmp_dirs(directory: str) -> list[str]:
  """Paths of orbax's unfinished step directories (`N.orbax-checkpoint-tmp*`) in `directory`."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  return [os.path.join(directory, n) for n in sorted(names)
          if _TMP_DIR_RE.match(n) and os.path.isdir(os.path.join(directory, n))]


def remove_stale_tmp_dirs(directory: str) -> list[str]:
  """Removes orbax's unfinished step directories in `directory`; returns their paths.

  They are saves a killed or failed run never committed (orbax never lists them). Only call this
  when no save into `directory` is in flight (the run holds the workdir lock).
  """
  removed = []
  for path in stale_tmp_dirs(directory):
    shutil.rmtree(path, ignore_errors=True)
    logging.info("removed the unfinished checkpoint save %s (left by an interrupted or failed "
                 "save; never committed)", path)
    removed.append(path)
  return removed
