"""Checkpoints of the train state plus host-side state, over `orbax.checkpoint.CheckpointManager`.

One checkpoint step directory holds two items written together and committed atomically (orbax writes
to a temporary directory and renames it when every item is on disk; unfinished steps are invisible):
  state  the device pytree (a `TrainState`: step, params, optimizer state, rng, ref params), sharded
  host   host-side state (replay buffer `state_dict()`, data cursor, numpy rng state...) as JSON.
Saving is asynchronous: `save` returns once the device arrays are copied to host memory (so the
next, donating train step may run at once) and the write goes on in a background thread.
Restoring takes target shardings, so a checkpoint saved on one mesh restores onto another.

Host state: nested dicts (str keys) / lists / tuples of numpy arrays, numpy or Python scalars,
strings, bytes and None. Arrays round-trip exactly (dtype, shape, bytes; base64 in the JSON);
tuples come back as tuples.
"""
from __future__ import annotations

import base64
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE, _HOST = "state", "host"


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
  """Keep-last-K, asynchronous, atomic checkpoints of (train state, host state) in `directory`.

  Usage:
    ckpt = Checkpointer(workdir + "/checkpoints", max_to_keep=3)
    restored = ckpt.restore(abstract_state=state)        # None when there is nothing to resume from
    if restored is not None:
      state, host = restored
    ...
    ckpt.save(step, state, host_state={"buffer": buf.state_dict(), "cursor": cursor})
    ckpt.close()                                          # waits for the last write
  When to save (every N steps) is the caller's decision: every `save` call writes a checkpoint.
  """

  def __init__(self, directory: str, max_to_keep: Optional[int] = 3, async_save: bool = True,
               create: bool = True):
    """`create=False` requires `directory` to exist (else FileNotFoundError), e.g. a resume dir."""
    directory = os.path.abspath(os.fspath(directory))
    if not create and not os.path.isdir(directory):
      raise FileNotFoundError(f"checkpoint directory {directory} does not exist; check the path or "
                              "pass create=True to start a new run there")
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"checkpoint directory {directory} is a file, not a directory")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 (or None to keep all)")
    self.directory = directory
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=create)
    self._manager = ocp.CheckpointManager(directory, options=options, item_names=(_STATE, _HOST))

  # -- queries --
  def all_steps(self) -> list[int]:
    """Steps of complete checkpoints, ascending (a save still in flight is not listed)."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # -- save / restore --
  def save(self, step: int, state: Any, host_state: Optional[dict] = None) -> None:
    """Starts writing checkpoint `step` (state + host_state) and returns; ValueError if it exists.

    host_state is encoded (copied) now, so the caller may change it right after `save` returns.
    """
    step = int(step)
    if step in self.all_steps():
      raise ValueError(f"checkpoint step {step} already exists in {self.directory}")
    host = {"host_state": encode_host_state(host_state)}
    self._manager.save(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(state), _HOST: ocp.args.JsonSave(host)}), force=True)

  def restore(self, step: Optional[int] = None, abstract_state: Any = None,
              shardings: Any = None) -> Optional[tuple[Any, Any]]:
    """(state, host_state) of checkpoint `step` (default: the newest complete one), or None if none.

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

  def wait(self) -> None:
    """Blocks until the in-flight save (if any) is on disk and committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the in-flight save, then releases the manager's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
