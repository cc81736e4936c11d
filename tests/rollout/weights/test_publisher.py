"""The publisher contract's shared parts: publisher roots (`claim_root`, `remove_stale_roots`)."""
import fcntl
import os
import subprocess
import sys


def test_stale_weight_roots_of_dead_processes_are_removed(tmp_path):
  """A run killed with -9 leaves /dev/shm/jaxreplay-<pid>-*; the next publisher removes those of
  dead pids and keeps live ones (another run on the machine) and unrelated names."""
  from jaxreplay.rollout.weights import publisher  # pylint: disable=g-import-not-at-top
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = tmp_path / f"jaxreplay-{dead.pid}-abc"
  (stale / "v3").mkdir(parents=True)
  (stale / "v3" / "model.safetensors").write_bytes(b"x" * 10)
  live = tmp_path / f"jaxreplay-{os.getppid()}-def"
  live.mkdir()
  mine = tmp_path / f"jaxreplay-{os.getpid()}-ghi"
  mine.mkdir()
  other = tmp_path / "jaxreplay-notapid-x"
  other.mkdir()
  # A live publisher whose pid is dead in this namespace (another container): its flock counts.
  elsewhere = tmp_path / f"jaxreplay-{dead.pid}-live"
  elsewhere.mkdir()
  fd = os.open(str(elsewhere / publisher.OWNER_FILE), os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_SH)  # as a publisher holds it
  removed = publisher.remove_stale_roots(str(tmp_path))
  assert removed == [str(stale)] and elsewhere.exists()
  assert not stale.exists() and live.exists() and mine.exists() and other.exists()
  os.close(fd)  # its publisher closed or died: stale now
  assert publisher.remove_stale_roots(str(tmp_path)) == [str(elsewhere)]
