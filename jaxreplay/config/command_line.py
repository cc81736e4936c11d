"""The launcher's command line checked before absl parses it, each problem as one line with its fix.

absl and ml_collections report a misspelled `--config.trainer.learnin_rate` as three chained
tracebacks, a missing config file only when the config is first read (after the workdir was made),
and a value that does not parse as an absl usage error. `check(argv)` finds these first:

  the config file   `--config` missing, a file that does not exist (with the nearest file of its
                    directory), a file whose get_config() fails
  overrides         each `--config.<key>=<value>`: a key the config does not have, with the nearest
                    keys (difflib over every dotted key, the same name in another section); a
                    section given a value; a value that does not parse as the key's type

and raises `CommandLineError` (a ValueError holding the line). `describe(exc, argv)` words an error
absl raised while parsing the remaining flags. Nothing here imports JAX.
"""
from __future__ import annotations

import difflib
import glob
import importlib.util
import os
import re
from typing import Any, Optional

from ml_collections import config_dict

FLAG = "config"
_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]+)(?:=(.*))?$")
_PRINT = "--print_config` lists every key"


class CommandLineError(ValueError):
  """A command-line problem, worded as one line: what is wrong; the fix."""


def config_arg(argv: list[str]) -> Optional[str]:
  """The value of --config in `argv` (`--config=X` or `--config X`), or None."""
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      return arg.split("=", 1)[1]
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def overrides(argv: list[str]) -> list[tuple[str, str, Optional[str]]]:
  """(argument, dotted key, value or None) of each `--config.<key>[=<value>]` in `argv`."""
  out = []
  for i, arg in enumerate(argv):
    m = _OVERRIDE.match(arg)
    if m:
      value = m.group(3)
      if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("-") and not m.group(1):
        value = argv[i + 1]
      out.append((arg, m.group(2), value))
  return out


def config_file_error(path: Optional[str]) -> Optional[str]:
  """A missing --config or a file that is not there, with the nearest file beside it."""
  if not path:
    return ("--config is missing; give a config file, e.g. --config=configs/tiny.py (the CPU "
            "default; configs/ holds the others)")
  file = path.split(":", 1)[0]
  if os.path.isfile(file):
    return None
  folder = os.path.dirname(file) or "."
  if not os.path.isdir(folder):
    return (f"--config={path}: no directory {folder!r}; give a config file, e.g. "
            "--config=configs/tiny.py")
  names = sorted(os.path.relpath(p) if not os.path.isabs(file) else p
                 for p in glob.glob(os.path.join(folder, "*.py")) if not p.endswith("__init__.py"))
  near = difflib.get_close_matches(file, names, n=1, cutoff=0.5)
  hint = (f"did you mean --config={near[0]}?" if near else
          f"{folder} holds {', '.join(os.path.basename(n) for n in names) or 'no .py file'}")
  return f"--config={path} does not exist; {hint}"


def load(path: str):
  """The ConfigDict of a config file: its get_config() (given what follows a ":" in `path`, as
  ml_collections does), locked; `CommandLineError` when the file cannot be run or returns no
  ConfigDict."""
  file, *args = path.split(":", 1)
  try:
    spec = importlib.util.spec_from_file_location("jaxreplay_launch_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(*args)
  except Exception as e:  # pylint: disable=broad-except  (the user's file: any error is theirs)
    text = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
    raise CommandLineError(f"--config={path}: loading it failed ({type(e).__name__}: {text}); fix "
                           "the file (--debug shows the traceback)") from e
  if not isinstance(config, config_dict.ConfigDict):
    raise CommandLineError(f"--config={path}: get_config() returned {type(config).__name__}, not "
                           "a ConfigDict; return the config (e.g. defaults.base_config() changed)")
  config.lock()
  return config


def keys(config, prefix: str = "") -> list[str]:
  """Every dotted key of `config`, sections included."""
  out = []
  for name, value in config.items():
    out.append(prefix + name)
    if isinstance(value, config_dict.ConfigDict):
      out += keys(value, f"{prefix}{name}.")
  return out


def nearest_keys(key: str, known: list[str]) -> list[str]:
  """The known keys `key` most likely meant: a near-identical spelling, else every key of that
  name in another section, else the closest spelling of the key or of its name."""
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
  if close:
    return close
  name = key.rsplit(".", 1)[-1]
  same = [k for k in known if k.rsplit(".", 1)[-1] == name]
  if same:
    return same
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
  if close:
    return close
  names = difflib.get_close_matches(name, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.75)
  if names:
    return [k for k in known if k.rsplit(".", 1)[-1] == names[0]]
  return difflib.get_close_matches(key, known, n=1, cutoff=0.5)


def _get(config, key: str) -> Any:
  value = config
  for part in key.split("."):
    value = value[part]
  return value


def _type_name(value: Any) -> str:
  if isinstance(value, bool):
    return "true or false"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  if isinstance(value, tuple):
    return "a tuple, e.g. \"(1, 2)\""
  return "a string"


def _example(value: Any) -> str:
  if isinstance(value, tuple):
    return f"\"{value}\""
  return str(value)


def override_error(config, key: str, value: Optional[str], config_path: str) -> Optional[str]:
  """The problem of one override `--config.<key>=<value>` of `config`, or None."""
  known = keys(config)
  if key not in known:
    near = nearest_keys(key, known)
    hint = ("did you mean " + " or ".join(f"--config.{k}" for k in near) + "?" if near
            else "check the spelling")
    return (f"--config.{key}: {config_path} has no such key; {hint} (`python -m jaxreplay.launch "
            f"--config={config_path} {_PRINT})")
  current = _get(config, key)
  if isinstance(current, config_dict.ConfigDict):
    example = next(iter(current.keys()), "key")
    return (f"--config.{key} is a section, not a key; set its keys, e.g. --config.{key}.{example}"
            f"={_example(current[example])}")
  return None


def value_error(config, key: str, value: Optional[str]) -> str:
  """The line for a value absl could not parse as the key's type."""
  current = _get(config, key)
  return (f"--config.{key}={value if value is not None else ''!s}: expected {_type_name(current)}"
          f"; e.g. --config.{key}={_example(current)} (its value in this config)")


def check(argv: list[str]) -> None:
  """The pre-parse checks of the module docstring; `CommandLineError` on the first problem."""
  path = config_arg(argv)
  problem = config_file_error(path)
  if problem:
    raise CommandLineError(problem)
  config = load(path)
  for _, key, value in overrides(argv):
    problem = override_error(config, key, value, path)
    if problem:
      raise CommandLineError(problem)


def describe(exc: BaseException, argv: list[str]) -> str:
  """One line for an error absl or ml_collections raised while parsing `argv`."""
  text = str(exc).strip()
  m = re.match(r"flag --config\.([^=\s]+)=(.*?): ", text)
  path = config_arg(argv)
  if m and path:
    try:
      return value_error(load(path), m.group(1), m.group(2))
    except (CommandLineError, KeyError):
      pass
  m = re.match(r"Unknown command line flag '([^']+)'(?:\. Did you mean: (.+?) \?)?", text)
  if m:
    hint = f"did you mean --{m.group(2).split(',')[0].strip()}?" if m.group(2) else (
        "see python -m jaxreplay.launch --help")
    return f"--{m.group(1)}: no such flag; {hint}"
  m = re.match(r"flag --(\w+)=(.*?): (.*)", text, re.S)
  if m:
    return f"--{m.group(1)}={m.group(2)}: {m.group(3).splitlines()[0]}; see python -m " \
           "jaxreplay.launch --help"
  first = text.splitlines()[-1] if text else type(exc).__name__
  return f"{first}; see python -m jaxreplay.launch --help (--debug shows the traceback)"

