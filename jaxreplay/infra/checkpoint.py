"""Checkpoints of the train state plus host-side state, over `orbax.checkpoint.CheckpointManager`.

One checkpoint step directory holds two items written together and committed atomically (orbax writes
to a temporary directory and renames it when every item is on disk; unfinished steps are invisible):
  state  the device pytree (a `TrainState`: step, params, optimizer state, rng, ref params), sharded
  host   host-side state (replay buffer `state_dict()`, data cursor, numpy rng state...) as JSON.
Saving is asynchronous: `save` returns once the device arrays are copied to host memory (so the
next, donating train step may run at once) and the write goes on in a background thread.
Restoring takes target shardings, so a checkpoint saved on one mesh restores onto another.

Integrity (`checkpoint_integrity`): every step carries `MANIFEST.sha256.json` (size and sha256 of
each file), written from orbax's post-finalization hook before the commit rename.
`restore_latest_valid` verifies steps newest first and falls back past damaged ones (truncated,
overwritten or deleted files), moving them to `<directory>.damaged/<step>`; when none is restorable
it raises `NoRestorableCheckpoint`. A failed save (disk full, ...) raises `CheckpointSaveError`, one
line with the free space, and its temporary directory is removed; orbax's background-thread
tracebacks are shortened to one log line each. Unfinished saves of a killed run are removed on
construction.

Host state: nested dicts (str keys) / lists / tuples of numpy arrays, numpy or Python scalars,
strings, bytes and None. Arrays round-trip exactly (dtype, shape, bytes; base64 in the JSON);
tuples come back as tuples.
"""
from __future__ import annotations

import base64
import errno
import glob
import logging as std_logging
import os
import shutil
from typing import Any, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from jaxreplay.infra import checkpoint_integrity as integrity

_STATE, _HOST = "state", "host"
_MAX_LINE = 300  # characters of an error message kept in a one-line error or log record


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (one line: directory, error, free space). `.error` is
  orbax's original exception (its traceback is not printed)."""

  def __init__(self, message: str, error: Optional[BaseException] = None):
    super().__init__(message)
    self.error = error


class NoRestorableCheckpoint(RuntimeError):
  """Every checkpoint step in the directory is damaged; the message lists each step and why."""


def _short(text: str, limit: int = _MAX_LINE) -> str:
  """`text` on one line, at most `limit` characters."""
  line = " ".join(str(text).split())
  return line if len(line) <= limit else line[:limit - 3] + "..."


def _error_line(e: BaseException) -> str:
  """One short line for exception `e`; disk full (ENOSPC, also in tensorstore's text) by name."""
  text = str(e)
  if ((isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in text
      or f"os_error_code='{errno.ENOSPC}'" in text):
    return "no space left on device (ENOSPC)"
  if isinstance(e, OSError) and e.errno in errno.errorcode and e.strerror:
    where = f" {e.filename}" if e.filename else ""
    return _short(f"{e.strerror} ({errno.errorcode[e.errno]}){where}")
  first = text.strip().splitlines()[0] if text.strip() else ""
  return _short(f"{type(e).__name__}: {first}" if first else type(e).__name__)


def _fmt_bytes(n: int) -> str:
  return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _free_space(path: str) -> str:
  """Free space (GiB / MiB) on the filesystem of `path` (or of its nearest existing parent)."""
  while path and not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return f"{_fmt_bytes(shutil.disk_usage(path).free)} free"
  except OSError as e:
    return f"free space unknown ({e.strerror})"


class _ShortOrbaxTracebacks(std_logging.Filter):
  """Drops the traceback of orbax's log records (its background save threads log one per thread,
  ~1000 lines for one disk-full error) and keeps one line: the message and the error's first line.
  The error itself reaches the caller as `CheckpointSaveError` (or as raised by a restore)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.exc_info and f"{os.sep}orbax{os.sep}" in (record.pathname or ""):
      exc = record.exc_info[1]
      tail = f" [{_error_line(exc)}]" if exc is not None else ""
      record.msg = (_short(record.getMessage()) + tail
                    + " (traceback dropped by jaxreplay.infra.checkpoint)")
      record.args = None
      record.exc_info = None
      record.exc_text = None
    return True


_ORBAX_FILTER = _ShortOrbaxTracebacks()


def _install_log_filter() -> None:
  """Adds `_ShortOrbaxTracebacks` to the `absl` logger (orbax logs through absl); idempotent."""
  std_logging.getLogger("absl").addFilter(_ORBAX_FILTER)


# ---- host state <-> JSON ----------------------------------------------------------------------

def encode_host_state(obj: Any) -> Any:
  """A JSON-serialisable copy of `obj` (see module docstring for what is supported)."""
  if obj is None or isinstance(obj, (bool, str)):
    return obj
  if isinstance(obj, (int, float)) and not isinstance(obj, (np.generic,)):
    return obj
  if isinstance(obj, np.generic) or isinstance(obj, (np.ndarray, jax.Array)):
    arr = np.asarray(obj)
    if arr.dtype == object:
      raise ValueError(f"host state cannot hold object arrays (got shape {arr.shape}); "
                       "store a list of arrays instead")
    return {"__ndarray__": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii"),
            "dtype": arr.dtype.str, "shape": list(arr.shape), "scalar": isinstance(obj, np.generic)}
  if isinstance(obj, bytes):
    return {"__bytes__": base64.b64encode(obj).decode("ascii")}
  if isinstance(obj, dict):
    for k in obj:
      if not isinstance(k, str):
        raise ValueError(f"host state dict keys must be str, got {k!r} ({type(k).__name__})")
      if k.startswith("__") and k.endswith("__"):
        raise ValueError(f"host state dict key {k!r} is reserved (dunder keys tag encoded values)")
    return {k: encode_host_state(v) for k, v in obj.items()}
  if isinstance(obj, tuple):
    return {"__tuple__": [encode_host_state(v) for v in obj]}
  if isinstance(obj, list):
    return [encode_host_state(v) for v in obj]
  raise ValueError(f"host state cannot hold {type(obj).__name__}: use dicts, lists, numpy arrays, "
                   "scalars, strings, bytes or None")


def decode_host_state(obj: Any) -> Any:
  """Inverse of `encode_host_state`."""
  if isinstance(obj, list):
    return [decode_host_state(v) for v in obj]
  if isinstance(obj, dict):
    if "__ndarray__" in obj:
      raw = base64.b64decode(obj["__ndarray__"])
      arr = np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
      return arr[()] if obj.get("scalar") else arr
    if "__bytes__" in obj:
      return base64.b64decode(obj["__bytes__"])
    if "__tuple__" in obj:
      return tuple(decode_host_state(v) for v in obj["__tuple__"])
    return {k: decode_host_state(v) for k, v in obj.items()}
  return obj


# ---- the checkpointer -------------------------------------------------------------------------

def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """`jax.ShapeDtypeStruct`s of `tree` (arrays or structs), with `shardings` (a matching tree)."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                      tree, shardings)


class Checkpointer:
  """Keep-last-K, asynchronous, atomic, verified checkpoints of (train state, host state).

  Usage:
    ckpt = Checkpointer(workdir + "/checkpoints", max_to_keep=3)
    resumed = ckpt.restore_latest_valid(abstract_state=state)   # None: nothing to resume from
    if resumed is not None:
      step, state, host, skipped = resumed                      # skipped: [(damaged step, why)]
    ...
    ckpt.save(step, state, host_state={"buffer": buf.state_dict(), "cursor": cursor})
    ckpt.close()                                                 # waits for the last write
  When to save (every N steps) is the caller's decision: every `save` call writes a checkpoint.
  A failed write raises `CheckpointSaveError` from `save` (the previous step's write, or this one's
  start), `wait` or `close`.
  """

  def __init__(self, directory: str, max_to_keep: Optional[int] = 3, async_save: bool = True,
               create: bool = True, clean_stale: bool = True):
    """`create=False` requires `directory` to exist (else FileNotFoundError), e.g. a resume dir.

    clean_stale: remove unfinished saves (`N.orbax-checkpoint-tmp*`) left by a killed run; pass
      False when another process may be saving into `directory` right now.
    async_save=False: `save` returns once the step is committed.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not create and not os.path.isdir(directory):
      raise FileNotFoundError(f"checkpoint directory {directory} does not exist; check the path or "
                              "pass create=True to start a new run there")
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"checkpoint directory {directory} is a file, not a directory")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 (or None to keep all)")
    self.directory = directory
    self.damaged_directory = directory + ".damaged"
    self._async = async_save
    self._saving_step: Optional[int] = None  # the step whose write may be in flight
    _install_log_filter()
    if clean_stale and jax.process_index() == 0:
      integrity.remove_stale_tmp_dirs(directory)
    # Always orbax's async checkpointer: its post-finalization hook writes the manifest into the
    # temporary directory before the commit rename (async_save=False waits in `save`).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=True, create=create,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest))
    self._manager = ocp.CheckpointManager(directory, options=options, item_names=(_STATE, _HOST))

  # -- queries --
  def all_steps(self) -> list[int]:
    """Steps of checkpoints, ascending. orbax lists a step as soon as its save starts (while it is
    still being written; `wait()` first for committed steps only); `Pipeline.checkpoint` relies on
    that to skip a step whose save is in flight."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> str:
    """The directory of committed checkpoint `step`."""
    return os.path.join(self.directory, str(int(step)))

  # -- save --
  def save(self, step: int, state: Any, host_state: Optional[dict] = None) -> None:
    """Starts writing checkpoint `step` (state + host_state) and returns; ValueError if it exists.

    host_state is encoded (copied) now, so the caller may change it right after `save` returns.
    Raises CheckpointSaveError when the previous save's write failed, or this one cannot start.
    """
    step = int(step)
    self._finish_pending()
    if step in self.all_steps():
      raise ValueError(f"checkpoint step {step} already exists in {self.directory}")
    host = {"host_state": encode_host_state(host_state)}
    self._saving_step = step
    try:
      self._manager.save(step, args=ocp.args.Composite(**{
          _STATE: ocp.args.StandardSave(state), _HOST: ocp.args.JsonSave(host)}), force=True,
          custom_metadata=integrity.save_metadata())
    except Exception as e:  # pylint: disable=broad-except
      self._save_failed(step, e)
    if not self._async:
      self._finish_pending()

  def _write_manifest(self) -> None:
    """orbax's post-finalization hook (its background thread, primary process): the items of
    `_saving_step` are finalised in the temporary directory, not yet renamed; hash them."""
    step = self._saving_step
    pattern = os.path.join(glob.escape(self.directory), f"{step}{integrity.TMP_DIR_SUFFIX}*")
    tmp_dirs = [d for d in glob.glob(pattern) if os.path.isdir(d)]
    if len(tmp_dirs) != 1:
      raise RuntimeError(f"cannot find the temporary directory of checkpoint step {step} in "
                         f"{self.directory} to write its manifest (found {tmp_dirs})")
    integrity.write_manifest(tmp_dirs[0])

  def _finish_pending(self) -> None:
    """Waits for the in-flight write; CheckpointSaveError when it failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._save_failed(self._saving_step, e)
    self._saving_step = None

  def _save_failed(self, step: Optional[int], error: BaseException) -> None:
    """Removes the failed save's temporary directory and raises a one-line CheckpointSaveError."""
    self._saving_step = None
    try:
      self._manager.wait_until_finished()  # let whatever orbax still runs for it end
    except Exception:  # pylint: disable=broad-except
      pass  # the same failure, already being reported
    removed = []
    if jax.process_index() == 0:
      for path in integrity.stale_tmp_dirs(self.directory):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    self._manager.reload()
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    cleaned = (f"; removed the unfinished save {', '.join(removed)}" if removed else "")
    raise CheckpointSaveError(
        f"{what} could not be saved to {self.directory}: {_error_line(error)}; "
        f"{_free_space(self.directory)} on that filesystem{cleaned}; earlier checkpoints are "
        "intact", error) from None

  # -- restore --
  def restore(self, step: Optional[int] = None, abstract_state: Any = None,
              shardings: Any = None) -> Optional[tuple[Any, Any]]:
    """(state, host_state) of checkpoint `step` (default: the newest complete one), or None if none.

    No integrity check (see `restore_latest_valid`).
    abstract_state: the target structure (a TrainState of arrays or `jax.ShapeDtypeStruct`s); arrays are
      restored with its shardings, or with `shardings` (a matching pytree) when given; this is how a
      checkpoint from another mesh lands on the current one. None: restore as saved (single process).
    Raises FileNotFoundError when `step` is given and no complete checkpoint has that step.
    """
    self.wait()
    steps = self.all_steps()
    if step is None:
      if not steps:
        return None
      step = steps[-1]
    elif int(step) not in steps:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                              f"available steps: {steps}")
    if abstract_state is None:
      state_args = ocp.args.StandardRestore()
    else:
      state_args = ocp.args.StandardRestore(abstract_like(abstract_state, shardings))
    out = self._manager.restore(int(step), args=ocp.args.Composite(**{
        _STATE: state_args, _HOST: ocp.args.JsonRestore()}))
    return out[_STATE], decode_host_state(out[_HOST]["host_state"])

  def restore_latest_valid(self, abstract_state: Any, shardings: Any = None
                           ) -> Optional[tuple[int, Any, Any, list[tuple[int, str]]]]:
    """(step, state, host_state, skipped) of the newest intact checkpoint, or None if there is none.

    Steps are tried newest first: one whose files fail `verify_step_dir` (sha256 manifest), or that
    has no manifest (saved before manifests existed) and orbax fails to restore, is damaged; once an
    older step restores, each damaged step is moved to `<directory>.damaged/<step>` (orbax never
    lists it again) with a WARNING, and listed in `skipped` as (step, one-line reason), newest
    first.
    A step that passes its sha256 check but that orbax cannot restore is not damaged (the target
    `abstract_state` / `shardings` do not match it): orbax's error is raised, nothing is moved.
    Raises NoRestorableCheckpoint when every step is damaged (nothing is moved then).
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      return None
    damaged: list[tuple[int, str]] = []
    for step in reversed(steps):
      reason, verified = self._check(step)
      if reason is None:
        try:
          state, host = self.restore(step, abstract_state=abstract_state, shardings=shardings)
        except Exception as e:  # pylint: disable=broad-except
          if verified:
            e.add_note(f"checkpoint step {step} in {self.directory} passed its sha256 check, so "
                       "its files are as saved: the current train state (model, optimizer, mesh) "
                       "probably does not match the run that saved it (weights a mesh axis does "
                       "not divide are stored padded, so their shapes depend on the mesh: resume "
                       "with the same trainer.mesh_shape and number of trainer devices)")
            raise
          reason = f"orbax could not restore it: {_error_line(e)}"
        else:
          for bad, why in damaged:
            moved = self._quarantine(bad)
            logging.warning("checkpoint step %d is damaged (%s); moved to %s; falling back to "
                            "step %d", bad, why, moved, step)
          return step, state, host, damaged
      logging.info("checkpoint step %d in %s is damaged (%s); trying an older step", step,
                   self.directory, reason)
      damaged.append((step, reason))
    listing = "\n".join(f"  step {s}: {why}" for s, why in damaged)
    raise NoRestorableCheckpoint(
        f"no restorable checkpoint in {self.directory}: no step could be verified and restored\n"
        f"{listing}\nIf the files are intact (no sha256 mismatch above), the config may not match "
        "the one that wrote them (model size, optimizer, mesh): resume with that config. "
        f"Otherwise move {self.directory} aside (e.g. to {self.directory}.bad; the run then "
        "restarts from step 0) or start a new workdir.")

  def _check(self, step: int) -> tuple[Optional[str], bool]:
    """(None or why step is damaged, whether a manifest verified it); decided by process 0."""
    path = self.step_dir(step)
    reason, verified = None, False
    if jax.process_index() == 0:
      problems = integrity.verify_step_dir(path)
      reason = _short("; ".join(problems)) if problems else None
      verified = not problems and os.path.exists(os.path.join(path, integrity.MANIFEST_NAME))
    if jax.process_count() > 1:  # every process must take the same branch (restore is collective)
      flags = multihost_utils.broadcast_one_to_all(np.array([reason is not None, verified]))
      if bool(flags[0]) and reason is None:
        reason = "its files do not match the manifest (see process 0's log)"
      verified = bool(flags[1])
    return reason, verified

  def _quarantine(self, step: int) -> str:
    """Moves step `step`'s directory to `<directory>.damaged/<step>[-k]`; returns the new path."""
    dest = os.path.join(self.damaged_directory, str(step))
    k = 1
    while os.path.lexists(dest):
      dest = os.path.join(self.damaged_directory, f"{step}-{k}")
      k += 1
    if jax.process_index() == 0:
      os.makedirs(self.damaged_directory, exist_ok=True)
      os.rename(self.step_dir(step), dest)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxreplay_checkpoint_quarantine_{step}")
    self._manager.reload()
    return dest

  # -- lifetime --
  def wait(self) -> None:
    """Blocks until the in-flight save (if any) is on disk and committed; CheckpointSaveError when
    its write failed."""
    self._finish_pending()

  def close(self) -> None:
    """Waits for the in-flight save, then releases the manager's threads."""
    try:
      self._finish_pending()
    finally:
      self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
