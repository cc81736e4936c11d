"""Checkpointer: async atomic save of (state, host state), keep-last-K, resume, restore on a new mesh."""
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

from jaxreplay.learner import batch as batch_lib
from jaxreplay.infra import checkpoint
from jaxreplay.infra import checkpoint_integrity
from jaxreplay.learner import optim
from jaxreplay.infra import sharding
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import presets
from jaxreplay.models import safetensors_io

CFG = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
B, T = 8, 32


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  mask[:, 8:] = 1.0
  return batch_lib.Batch(
      tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
      segment_ids=np.ones((B, T), np.int32), targets=np.roll(tokens, -1, axis=1),
      completion_mask=mask, behaviour_logprobs=np.where(mask > 0, -4.1, 0.0).astype(np.float32),
      advantages=rng.normal(size=B).astype(np.float32), rewards=np.zeros(B, np.float32),
      policy_version=np.zeros(B, np.int32))


def _host(x):
  return jax.tree.map(np.asarray, x)


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh((1, 4, 2))
  opt = optim.make_optimizer(1e-3, warmup_steps=2, weight_decay=0.01)
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(0), mesh=mesh)
  shardings = trainer.state_shardings(state, mesh)
  step = trainer.make_train_step(CFG, opt, loss_fn_lib.make_loss_fn("grpo"), mesh, shardings,
                                 chunk_size=16, compute_entropy=False)
  return mesh, opt, state, shardings, step


def test_host_state_round_trip():
  host = {"buffer": {"tokens": [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64)],
                     "rewards": np.array([0.5, 1.0], np.float32), "empty": [], "meta": {}},
          "cursor": 17, "name": "run", "ratio": 0.25, "flag": True, "none": None,
          "seed_state": (np.uint64(12345), np.array([[1, 2], [3, 4]], np.uint32)),
          "raw": b"\x00\x01", "np_int": np.int64(-3), "bf": np.array([1.5], np.float16)}
  back = checkpoint.decode_host_state(checkpoint.encode_host_state(host))
  assert back["cursor"] == 17 and back["name"] == "run" and back["flag"] is True
  assert back["none"] is None and back["raw"] == b"\x00\x01" and back["buffer"]["empty"] == []
  assert isinstance(back["seed_state"], tuple) and back["seed_state"][0] == np.uint64(12345)
  assert back["seed_state"][0].dtype == np.uint64 and back["np_int"].dtype == np.int64
  for got, want in zip(back["buffer"]["tokens"], host["buffer"]["tokens"]):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(back["seed_state"][1], host["seed_state"][1])
  assert back["bf"].dtype == np.float16


@pytest.mark.parametrize("bad,match", [({1: 2}, "keys must be str"), ({"x": object()}, "cannot hold"),
                                       ({"__tuple__": 1}, "reserved"),
                                       ({"x": np.array([None])}, "object arrays")])
def test_host_state_rejects_unsupported(bad, match):
  with pytest.raises(ValueError, match=match):
    checkpoint.encode_host_state(bad)


def test_save_restore_continue_is_exact(setup, tmp_path):
  mesh, opt, state, shardings, step = setup
  batch = _batch()
  state = jax.tree.map(lambda x: x.copy(), state)  # the module fixture's state must not be donated
  state, _ = step(state, batch)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  host = {"cursor": np.int64(3), "buffer": {"x": np.arange(4)}}
  ckpt.save(1, state, host_state=host)
  host["cursor"] = np.int64(99)  # mutated after save: the checkpoint holds the value at save time
  # Never stopping: the next step runs at once (it donates `state` while the save may be in flight).
  state2, metrics2 = step(state, _batch(1))
  expected = _host(state2)
  ckpt.wait()
  restored = ckpt.restore(abstract_state=jax.eval_shape(lambda: state2), shardings=shardings)
  assert restored is not None
  rstate, rhost = restored
  assert isinstance(rstate, trainer.TrainState) and int(rstate.step) == 1
  assert int(rhost["cursor"]) == 3
  np.testing.assert_array_equal(rhost["buffer"]["x"], np.arange(4))
  rstate2, rmetrics2 = step(rstate, _batch(1))
  chex.assert_trees_all_equal(_host(rstate2), expected)
  chex.assert_trees_all_equal(_host(rmetrics2), _host(metrics2))
  ckpt.close()


def test_keep_last_k_and_latest(setup, tmp_path):
  _, _, state, _, _ = setup
  with checkpoint.Checkpointer(str(tmp_path / "c"), max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.restore(abstract_state=state) is None  # nothing to resume from
    for s in (10, 20, 30):
      ckpt.save(s, state, {"s": s})
    ckpt.wait()
    assert ckpt.all_steps() == [20, 30] and ckpt.latest_step() == 30
    _, host = ckpt.restore(abstract_state=state)
    assert host == {"s": 30}
    _, host = ckpt.restore(20, abstract_state=state)
    assert host == {"s": 20}
    with pytest.raises(FileNotFoundError, match=r"step 10 .* available steps: \[20, 30\]"):
      ckpt.restore(10, abstract_state=state)
    with pytest.raises(ValueError, match="already exists"):
      ckpt.save(30, state)


def test_incomplete_checkpoint_is_ignored(setup, tmp_path):
  _, _, state, _, _ = setup
  d = tmp_path / "c"
  with checkpoint.Checkpointer(str(d)) as ckpt:
    ckpt.save(5, state)
  # A crash mid-save leaves orbax's temporary directory; resuming must skip it.
  os.makedirs(d / "7.orbax-checkpoint-tmp-1234" / "state")
  with checkpoint.Checkpointer(str(d)) as ckpt:
    assert ckpt.all_steps() == [5]
    _, host = ckpt.restore(abstract_state=state)
    assert host is None


def test_restore_onto_a_different_mesh(setup, tmp_path):
  _, opt, state, _, _ = setup
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    ckpt.save(1, state)
  other = sharding.make_mesh((2, 2, 2))
  abstract = jax.eval_shape(lambda: state)
  new_shardings = trainer.state_shardings(abstract, other)
  with checkpoint.Checkpointer(str(tmp_path / "c"), create=False) as ckpt:
    rstate, _ = ckpt.restore(abstract_state=abstract, shardings=new_shardings)
  chex.assert_trees_all_equal(_host(rstate), _host(state))
  q = rstate.params["layers"]["q_proj"]
  assert q.sharding.mesh.shape == other.shape
  assert q.sharding.is_equivalent_to(new_shardings.params["layers"]["q_proj"], q.ndim)
  mu = rstate.opt_state[1][0].mu["layers"]["down_proj"]
  assert mu.sharding.is_equivalent_to(new_shardings.opt_state[1][0].mu["layers"]["down_proj"], 3)
  # And onto a single device.
  single = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    rstate, _ = ckpt.restore(abstract_state=abstract,
                             shardings=trainer.state_shardings(abstract, single))
  chex.assert_trees_all_equal(_host(rstate), _host(state))
  assert len(rstate.params["embed_tokens"].sharding.device_set) == 1


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.Checkpointer(str(tmp_path / "missing"), create=False)
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    checkpoint.Checkpointer(str(tmp_path / "afile"))
  with pytest.raises(ValueError, match="max_to_keep"):
    checkpoint.Checkpointer(str(tmp_path / "c"), max_to_keep=0)


# ---- integrity: manifests, damaged steps, failed saves, stale temporary directories -------------

def _tree(value):
  """A small pytree whose every leaf holds `value` (so steps are told apart by their contents)."""
  return {"w": np.full((64, 32), value, np.float32), "b": np.full((7,), int(value), np.int32)}


def _saved(tmp_path, steps=(1, 2)):
  """A checkpoint directory holding one step per entry of `steps` (`_tree(step)`, host {"s": step})."""
  d = str(tmp_path / "ckpt")
  with checkpoint.Checkpointer(d, max_to_keep=None) as ckpt:
    for s in steps:
      ckpt.save(s, _tree(s), {"s": s})
  return d


def _data_files(step_dir):
  """The state item's data files (not metadata) of a step, largest first."""
  found = []
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for f in files:
      if os.path.basename(root) == "d":
        found.append(os.path.join(root, f))
  assert found, f"no data files under {step_dir}/state"
  return sorted(found, key=lambda p: (-os.path.getsize(p), p))


def _restore_valid(d):
  with checkpoint.Checkpointer(d) as ckpt:
    return ckpt.restore_latest_valid(abstract_state=_tree(0)), ckpt.all_steps()


def test_manifest_written_before_commit_and_verified(tmp_path, monkeypatch):
  seen = []
  real = checkpoint_integrity.write_manifest

  def spy(step_dir):
    final = step_dir.split(checkpoint_integrity.TMP_DIR_SUFFIX)[0]
    seen.append((os.path.basename(step_dir), os.path.exists(final)))
    return real(step_dir)

  monkeypatch.setattr(checkpoint_integrity, "write_manifest", spy)
  d = _saved(tmp_path)
  # Written in orbax's temporary directory, while the step is not yet visible.
  assert seen == [("1.orbax-checkpoint-tmp", False), ("2.orbax-checkpoint-tmp", False)]
  step_dir = os.path.join(d, "2")
  with open(os.path.join(step_dir, checkpoint_integrity.MANIFEST_NAME)) as f:
    manifest = json.load(f)
  on_disk = set()
  for root, _, files in os.walk(step_dir):
    on_disk |= {os.path.relpath(os.path.join(root, n), step_dir) for n in files}
  assert set(manifest["files"]) == on_disk - {"MANIFEST.sha256.json", "_CHECKPOINT_METADATA",
                                              "commit_success.txt"}
  assert "state/_METADATA" in manifest["files"] and "host/metadata" in manifest["files"]
  for rel, entry in manifest["files"].items():
    with open(os.path.join(step_dir, rel), "rb") as f:
      raw = f.read()
    assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
  assert checkpoint_integrity.verify_step_dir(step_dir) == []
  resumed, steps = _restore_valid(d)
  step, state, host, skipped = resumed
  assert (step, host, skipped, steps) == (2, {"s": 2}, [], [1, 2])
  chex.assert_trees_all_equal(_host(state), _tree(2))


def _overwrite_8_bytes(step_dir):
  path = _data_files(step_dir)[0]
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    old = f.read(8)
    f.seek(-8, os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in old))
  return os.path.relpath(path, step_dir), "sha256 differs from the manifest"


def _truncate(step_dir):
  path = _data_files(step_dir)[0]
  size = os.path.getsize(path)
  os.truncate(path, size // 2)
  return os.path.relpath(path, step_dir), f"has {size // 2} bytes, the manifest says {size}"


def _delete_metadata(step_dir):
  os.remove(os.path.join(step_dir, "state", "_METADATA"))
  return "state/_METADATA", "missing"


def _garble_step_metadata(step_dir):
  with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "w") as f:
    f.write('{"item_handlers": {"sta')
  return "_CHECKPOINT_METADATA", "unreadable (JSONDecodeError"


def _garble_host(step_dir):
  with open(os.path.join(step_dir, "host", "metadata"), "w") as f:
    f.write("[1, 2")
  return "host/metadata", "has 5 bytes, the manifest says"


def _delete_manifest(step_dir):
  os.remove(os.path.join(step_dir, checkpoint_integrity.MANIFEST_NAME))
  return "MANIFEST.sha256.json", "missing although the save wrote one"


@pytest.mark.parametrize("damage", [_overwrite_8_bytes, _truncate, _delete_metadata,
                                    _garble_step_metadata, _garble_host, _delete_manifest])
def test_damaged_newest_step_falls_back(tmp_path, damage, caplog):
  d = _saved(tmp_path, steps=(1, 2, 3))
  what, why = damage(os.path.join(d, "3"))
  problems = checkpoint_integrity.verify_step_dir(os.path.join(d, "3"))
  assert len(problems) == 1 and problems[0].startswith(f"{what} {why}"), problems
  assert checkpoint_integrity.verify_step_dir(os.path.join(d, "2")) == []
  caplog.set_level(logging.INFO)
  resumed, steps = _restore_valid(d)
  step, state, host, skipped = resumed
  assert (step, host, steps) == (2, {"s": 2}, [1, 2])
  chex.assert_trees_all_equal(_host(state), _tree(2))
  assert len(skipped) == 1 and skipped[0][0] == 3 and skipped[0][1] == problems[0]
  assert os.listdir(d + ".damaged") == ["3"] and not os.path.exists(os.path.join(d, "3"))
  # Ours only: orbax warns "Waiting for previous save to complete" when the machine is slow.
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "jaxreplay" in r.pathname]
  assert warnings == [f"checkpoint step 3 is damaged ({problems[0]}); moved to {d}.damaged/3; "
                      "falling back to step 2"]
  # The next run sees step 2 as the newest and may save step 3 again.
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.save(3, _tree(30), {"s": 30})
  resumed, steps = _restore_valid(d)
  assert resumed[0] == 3 and resumed[2] == {"s": 30} and resumed[3] == [] and steps == [1, 2, 3]


def test_two_damaged_steps_fall_back_to_the_oldest(tmp_path):
  d = _saved(tmp_path, steps=(1, 2, 3))
  _overwrite_8_bytes(os.path.join(d, "3"))
  _truncate(os.path.join(d, "2"))
  resumed, steps = _restore_valid(d)
  step, state, host, skipped = resumed
  assert (step, host, steps) == (1, {"s": 1}, [1])
  assert [s for s, _ in skipped] == [3, 2]
  assert "sha256 differs" in skipped[0][1] and "bytes, the manifest says" in skipped[1][1]
  assert sorted(os.listdir(d + ".damaged")) == ["2", "3"]


def _strip_manifest(step_dir):
  """Makes `step_dir` look saved by a jaxreplay without manifests."""
  os.remove(os.path.join(step_dir, checkpoint_integrity.MANIFEST_NAME))
  meta_path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
  with open(meta_path) as f:
    meta = json.load(f)
  meta["custom_metadata"] = {}
  with open(meta_path, "w") as f:
    json.dump(meta, f)


def test_steps_without_a_manifest(tmp_path, caplog):
  d = _saved(tmp_path, steps=(1, 2, 3))
  for s in (1, 2, 3):
    _strip_manifest(os.path.join(d, str(s)))
  caplog.set_level(logging.INFO)
  assert checkpoint_integrity.verify_step_dir(os.path.join(d, "3")) == []
  assert any("has no MANIFEST.sha256.json (saved before manifests existed)" in r.getMessage()
             for r in caplog.records)
  # Unverifiable: an orbax failure marks it damaged (falls back).
  os.remove(os.path.join(d, "3", "state", "_METADATA"))
  resumed, steps = _restore_valid(d)
  step, state, host, skipped = resumed
  assert (step, host, steps) == (2, {"s": 2}, [1, 2])
  assert skipped[0][0] == 3 and skipped[0][1].startswith("orbax could not restore it: ")
  chex.assert_trees_all_equal(_host(state), _tree(2))


def test_verified_step_that_does_not_fit_the_target_is_not_moved(tmp_path):
  d = _saved(tmp_path, steps=(1,))
  wrong = {"w": np.zeros((64, 32), np.float32), "c": np.zeros((7,), np.int32)}  # "c", not "b"
  with checkpoint.Checkpointer(d) as ckpt:
    with pytest.raises(ValueError, match="Structure mismatch") as info:
      ckpt.restore_latest_valid(abstract_state=wrong)
    assert ckpt.all_steps() == [1]
  assert any("passed its sha256 check" in n for n in getattr(info.value, "__notes__", []))
  assert not os.path.exists(d + ".damaged")


def test_all_damaged_raises_and_moves_nothing(tmp_path):
  d = _saved(tmp_path, steps=(1, 2))
  _truncate(os.path.join(d, "2"))
  _delete_metadata(os.path.join(d, "1"))
  with checkpoint.Checkpointer(d) as ckpt:
    with pytest.raises(checkpoint.NoRestorableCheckpoint) as info:
      ckpt.restore_latest_valid(abstract_state=_tree(0))
    assert ckpt.all_steps() == [1, 2]
  msg = str(info.value)
  assert msg.startswith(f"no restorable checkpoint in {d}: no step could be verified and restored\n")
  lines = msg.splitlines()
  assert lines[1].startswith("  step 2: state/") and "bytes, the manifest says" in lines[1]
  assert lines[2] == "  step 1: state/_METADATA missing"
  assert lines[3].startswith("If the files are intact") and f"move {d} aside" in lines[3]
  assert "new workdir" in lines[3] and "delete" not in lines[3]
  assert not os.path.exists(d + ".damaged")


def test_nothing_to_restore(tmp_path):
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    assert ckpt.restore_latest_valid(abstract_state=_tree(0)) is None


def test_stale_tmp_dirs_removed_at_construction(tmp_path, caplog):
  d = _saved(tmp_path, steps=(1,))
  for name in ("7.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1234"):
    os.makedirs(os.path.join(d, name, "state"))
    (tmp_path / "ckpt" / name / "state" / "x").write_bytes(b"partial")
  (tmp_path / "ckpt" / "notes.orbax-checkpoint-tmp").mkdir()  # not a step: kept
  with checkpoint.Checkpointer(d, clean_stale=False):
    assert os.path.exists(os.path.join(d, "7.orbax-checkpoint-tmp"))
  caplog.set_level(logging.INFO)
  with checkpoint.Checkpointer(d) as ckpt:
    assert ckpt.all_steps() == [1]
  assert sorted(os.listdir(d)) == ["1", "notes.orbax-checkpoint-tmp"]
  removed = [r.getMessage() for r in caplog.records if "unfinished checkpoint save" in r.getMessage()]
  assert len(removed) == 2
  assert os.path.join(d, "7.orbax-checkpoint-tmp") in removed[0]
  assert os.path.join(d, "8.orbax-checkpoint-tmp-1234") in removed[1]


def test_failed_save_is_one_line_with_free_space(tmp_path, monkeypatch, caplog):
  d = str(tmp_path / "c")
  caplog.set_level(logging.INFO)

  def disk_full(step_dir):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(step_dir, "MANIFEST"))

  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.save(1, _tree(1), {"s": 1})
    ckpt.wait()
    # In orbax's background thread (after every item is written): raised by the next wait / save.
    monkeypatch.setattr(checkpoint_integrity, "write_manifest", disk_full)
    ckpt.save(2, _tree(2), {"s": 2})
    with pytest.raises(checkpoint.CheckpointSaveError) as info:
      ckpt.wait()
    msg = str(info.value)
    assert "\n" not in msg and info.value.__suppress_context__
    assert re.fullmatch(
        rf"checkpoint step 2 could not be saved to {re.escape(d)}: no space left on device "
        r"\(ENOSPC\); \d+\.\d (GiB|MiB) free on that filesystem; removed the unfinished save "
        r"2\.orbax-checkpoint-tmp; earlier checkpoints are intact", msg), msg
    assert isinstance(info.value.error, OSError) and info.value.error.errno == errno.ENOSPC
    assert sorted(os.listdir(d)) == ["1"] and ckpt.all_steps() == [1]
    # orbax's background-thread errors are logged without their tracebacks.
    orbax_errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert orbax_errors and all(r.exc_info is None and r.exc_text is None for r in orbax_errors)
    assert all("traceback dropped" in r.getMessage() for r in orbax_errors)
    assert not any("Traceback" in r.getMessage() for r in caplog.records)
    # A failure when the save starts.
    monkeypatch.undo()

    def refuse(*args, **kwargs):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt._manager, "save", refuse)
    with pytest.raises(checkpoint.CheckpointSaveError,
                       match=r"^checkpoint step 3 could not be saved to .*: no space left on "
                             r"device \(ENOSPC\); \d+\.\d (GiB|MiB) free on that filesystem; "
                             r"earlier checkpoints are intact$"):
      ckpt.save(3, _tree(3))
    monkeypatch.undo()
    # The disk has room again: saving goes on.
    ckpt.save(4, _tree(4), {"s": 4})
  resumed, steps = _restore_valid(d)
  assert resumed[0] == 4 and resumed[2] == {"s": 4} and steps == [1, 4]


def test_async_false_save_is_committed_on_return(tmp_path):
  with checkpoint.Checkpointer(str(tmp_path / "c"), async_save=False) as ckpt:
    ckpt.save(1, _tree(1), {"s": 1})
    assert os.listdir(tmp_path / "c") == ["1"]
    assert checkpoint_integrity.verify_step_dir(ckpt.step_dir(1)) == []


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_remove_stale_staging(tmp_path, caplog):
  host = socket.gethostname()
  dead = tmp_path / f".hf.tmp-{_dead_pid()}@{host}-abcd1234"
  live = tmp_path / f".hf.tmp-{os.getpid()}@{host}-efgh5678"
  other_host = tmp_path / f".hf.tmp-{_dead_pid()}@not-{host}-ijkl9012"
  dead_old = tmp_path / f".hf.old-{_dead_pid()}@{host}-0123abcd"    # hf exists: removed
  orphan_old = tmp_path / f".v1.old-{_dead_pid()}@{host}-4567abcd"  # v1 missing: the only copy
  legacy_fresh = tmp_path / ".hf.tmp-zz_12345"
  legacy_stale = tmp_path / ".hf.tmp-yy_67890"
  unrelated = tmp_path / ".hf.tmp-notes"
  for p in (dead, live, other_host, dead_old, orphan_old, legacy_fresh, legacy_stale, unrelated,
            tmp_path / "hf"):
    p.mkdir()
    (p / "model.safetensors").write_bytes(b"partial")
  os.utime(legacy_stale, (time.time() - 7200, time.time() - 7200))
  caplog.set_level(logging.INFO)
  removed = safetensors_io.remove_stale_staging(str(tmp_path))
  assert sorted(removed) == sorted(str(p) for p in (dead, dead_old, legacy_stale))
  assert sorted(os.listdir(tmp_path)) == sorted(
      p.name for p in (live, other_host, orphan_old, legacy_fresh, unrelated, tmp_path / "hf"))
  messages = [r.getMessage() for r in caplog.records]
  assert any(str(dead) in m and "is gone" in m for m in messages)
  assert any(str(orphan_old) in m and "rename it back" in m for m in messages)
  # staged_dir cleans the parent before it writes, and names its staging dir after the writer.
  dead2 = tmp_path / f".hf.tmp-{_dead_pid()}@{host}-mnop3456"
  dead2.mkdir()
  with safetensors_io.staged_dir(str(tmp_path / "hf")) as tmp:
    assert os.path.basename(tmp).startswith(f".hf.tmp-{os.getpid()}@")
    assert not dead2.exists() and live.exists()
    (pathlib.Path(tmp) / "config.json").write_text("{}")
  assert os.listdir(tmp_path / "hf") == ["config.json"]
