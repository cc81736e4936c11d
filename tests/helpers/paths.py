"""Where the tests find the repository: the root of `jaxreplay/`, `configs/`, `bench/`, `assets/`;
`bench_module` imports a script of `bench/` (not a package) as a module."""
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_module(name: str):
  """`bench/<name>.py` imported (bench/ on sys.path only while it imports)."""
  bench = os.path.join(REPO, "bench")
  sys.path.insert(0, bench)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(bench)
