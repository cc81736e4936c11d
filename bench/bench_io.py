"""Where a bench writes its JSON: `--out` names a directory (the bench's default file name in it)
or a .json file."""
from __future__ import annotations

import json
import os


def write_json(out: str, default_name: str, data) -> str:
  """Writes `data` (indented JSON) to `out` (a .json path, or a directory: `default_name` in it,
  made if missing); returns the path."""
  path = out if out.endswith(".json") else os.path.join(out, default_name)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=2)
  return path
