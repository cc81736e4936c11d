"""`FilePublisher` (rollout.weight_transport="file"): versions as HF directories, written
atomically, the newest `keep` kept, under a root claimed in /dev/shm (or a temporary directory)."""
import os

import chex
import jax
import pytest

from jaxreplay.models import presets
from jaxreplay.models import transformer


def test_file_publisher_writes_versions_atomically_and_keeps_the_newest(tmp_path):
  from jaxreplay.models.hf_io import load_hf
  from jaxreplay.rollout.weights.file_publisher import FilePublisher

  cfg = presets.tiny()
  params = [transformer.init_params(cfg, jax.random.key(s)) for s in range(3)]
  root = tmp_path / "pub"
  with FilePublisher(cfg, root=str(root), keep=2) as pub:
    handles = [pub.publish(p, version=v) for v, p in zip((0, 4, 7), params)]
    assert [w.version for w in handles] == [0, 4, 7] and all(w.cfg == cfg for w in handles)
    dirs = [w.hf_dir for w in handles]
    assert dirs == [str(root / f"v{v}") for v in (0, 4, 7)]
    assert sorted(os.listdir(root)) == ["v4", "v7"]  # only the newest 2; no temporary dirs left
    loaded_cfg, loaded = load_hf(dirs[-1])
    assert loaded_cfg == cfg
    chex.assert_trees_all_close(loaded, params[2], atol=0, rtol=0)
    rec = pub.latest
    assert rec.version == 7 and rec.location == dirs[-1]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params[2]))
    assert rec.nbytes == 4 * n_params  # float32, one safetensors file
    assert rec.stall_s > rec.write_s > 0 and len(pub.history) == 3  # stall_s: transfer + write
    with pytest.raises(ValueError, match="newer"):
      pub.publish(params[0], version=7)
  assert os.path.isdir(root) and os.listdir(root) == []  # a given root stays; its versions go


def test_file_publisher_default_root_and_fallback(monkeypatch):
  from jaxreplay.rollout.weights import file_publisher
  from jaxreplay.rollout.weights import publisher

  cfg = presets.tiny()
  pub, other = file_publisher.FilePublisher(cfg), file_publisher.FilePublisher(cfg)
  try:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
      assert pub.root.startswith(f"/dev/shm/jaxreplay-{os.getpid()}-")
    assert os.path.isdir(pub.root) and other.root != pub.root
  finally:
    pub.close()
  assert not os.path.exists(pub.root) and os.path.isdir(other.root)  # closing one spares the other
  other.close()
  monkeypatch.setattr(publisher.os.path, "isdir",
                      lambda p: False if p == "/dev/shm" else os.path.lexists(p))
  root = publisher.default_root()
  try:
    assert not root.startswith("/dev/shm") and os.path.isdir(root)
  finally:
    os.rmdir(root)
  with pytest.raises(ValueError, match="keep"):
    file_publisher.FilePublisher(cfg, keep=0)
