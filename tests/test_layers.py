"""The layer contracts of pyproject.toml's [tool.importlinter] (import-linter): every layer imports
only the layers below it, and the generic rollout parts and the tables read before JAX starts import
no JAX, vLLM, Ray or torch. `.ci/run` runs `lint-imports` first; this runs it in the suite."""
import os
import shutil
import subprocess
import sys

from tests.helpers.paths import REPO


def lint_imports() -> subprocess.CompletedProcess:
  exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
  assert os.path.exists(exe), "import-linter is not installed: pip install -e '.[test]'"
  return subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=REPO))


def test_the_layer_contracts_are_kept():
  out = lint_imports()
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  assert " kept, 0 broken." in out.stdout and "BROKEN" not in out.stdout, out.stdout[-2000:]
  for name in ("layers: entry points > science > run > config", "import no JAX, vLLM, Ray or torch"):
    assert name in " ".join(out.stdout.split()), name  # both contracts were checked
