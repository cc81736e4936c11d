"""What each config key means, from one place: the comments of `config/defaults.py`.

`base_config()` states every key on one line, `c.<section>.<key> = <default>  # <meaning>`, the
meaning going on over the comment lines indented under it. `descriptions()` parses that function
once (`ast` for the assignments, `tokenize` for the comments) into {dotted key: one-line meaning};
a comment line at the statements' own indentation is a note about the keys that follow it
(`notes()`). Everything that explains a key reads it here:

  `format_config(config)`   `python -m jaxreplay.launch --print_config`: every key, its value and
                            its meaning, one line each
  `markdown()`              the configuration reference page, docs/reference/configuration.md:
                            `python -m jaxreplay.config.reference --out docs/reference/configuration.md`
                            (`--check` exits 1 when the file differs from what it would write)

A key without a meaning is an error (`missing_descriptions`, checked by the tests).
"""
from __future__ import annotations

import argparse
import ast
import functools
import io
import os
import sys
import tokenize
from typing import Any, Iterator, Optional

from jaxreplay.config import defaults

PAGE = os.path.join("docs", "reference", "configuration.md")
COMMAND = "python -m jaxreplay.config.reference --out " + PAGE


def _dotted(node: ast.expr) -> Optional[str]:
  """"model.lora_rank" for the target `c.model.lora_rank`; None for any other target."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name) and node.id == "c" and parts:
    return ".".join(reversed(parts))
  return None


@functools.cache
def _parsed() -> tuple[dict[str, str], dict[str, str]]:
  """({key: meaning}, {key: note before it}) of `defaults.base_config`'s source."""
  with open(defaults.__file__, encoding="utf-8") as f:
    source = f.read()
  comments: dict[int, tuple[int, str]] = {}  # line -> (column, text without "#")
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  fn = next(n for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and n.name == "base_config")
  meanings, notes = {}, {}
  pending_note: list[str] = []
  for line in range(fn.body[0].lineno, fn.end_lineno + 1):  # notes: comment-only lines at col 2
    if line in comments and line not in code_lines and comments[line][0] == fn.body[0].col_offset:
      pending_note.append(comments[line][1])
    stmt = next((s for s in fn.body if s.lineno == line), None)
    if not isinstance(stmt, ast.Assign) or _dotted(stmt.targets[0]) is None:
      continue
    key = _dotted(stmt.targets[0])
    text = [comments[l][1] for l in range(stmt.lineno, stmt.end_lineno + 1) if l in comments]
    nxt = stmt.end_lineno + 1  # the meaning goes on over comment-only lines indented under it
    while nxt in comments and nxt not in code_lines and comments[nxt][0] > stmt.col_offset:
      text.append(comments[nxt][1])
      nxt += 1
    meanings[key] = " ".join(t for t in text if t)
    if pending_note:
      notes[key] = " ".join(pending_note)
      pending_note = []
  return meanings, notes


def descriptions() -> dict[str, str]:
  """{dotted key: its one-line meaning} of every key (and section) of `base_config()`."""
  return dict(_parsed()[0])


def notes() -> dict[str, str]:
  """{dotted key: the comment block written above it} (a note about the keys that follow)."""
  return dict(_parsed()[1])


def _leaves(config, prefix: str = "") -> Iterator[tuple[str, Any]]:
  for key, value in config.items():
    name = f"{prefix}{key}"
    if hasattr(value, "items"):
      yield from _leaves(value, name + ".")
    else:
      yield name, value


def flat_items(config) -> list[tuple[str, Any]]:
  """(dotted key, value) of every leaf of a ConfigDict (sections are not leaves), in the order of
  `base_config()`'s source; keys it does not state last, sorted."""
  order = {k: i for i, k in enumerate(descriptions())}
  return sorted(_leaves(config), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))


def missing_descriptions(config=None) -> list[str]:
  """The keys (and sections) of `config` (default `base_config()`) without a meaning."""
  config = defaults.base_config() if config is None else config
  known = descriptions()
  sections = {k.rsplit(".", 1)[0] for k, _ in flat_items(config) if "." in k}
  return [k for k in [k for k, _ in flat_items(config)] + sorted(sections) if not known.get(k)]


def _value(value: Any) -> str:
  if isinstance(value, str):
    return repr(value)
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def format_config(config) -> str:
  """`--print_config`: one line per key, `key = value  # meaning`, the sections in their order."""
  known = descriptions()
  items = list(flat_items(config))
  width = min(48, max(len(f"{k} = {_value(v)}") for k, v in items))
  lines, section = [], None
  for key, value in items:
    head = key.rsplit(".", 1)[0] if "." in key else ""
    if head != section:
      section = head
      if head:
        lines.append(f"\n[{head}]  {known.get(head, '')}".rstrip())
    lines.append(f"{f'{key} = {_value(value)}':<{width}}  # {known.get(key, '(no description)')}")
  return "\n".join(lines).lstrip("\n")


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("*", "\\*")


def markdown() -> str:
  """The configuration reference page: a table per section of every key, its default and its
  meaning (generated; the header says by which command)."""
  c = defaults.base_config()
  known, note = descriptions(), notes()
  out = ["# Configuration reference", "",
         f"<!-- generated by `{COMMAND}` from the comments of jaxreplay/config/defaults.py; "
         "do not edit -->", "",
         "Every key a run reads, with its default and its meaning. A config file starts from "
         "`base_config()` (`jaxreplay/config/defaults.py`) and changes what it needs; any key is "
         "overridden on the command line, e.g. `--config.buffer.size=128`. "
         "`python -m jaxreplay.launch --config=configs/tiny.py --print_config` prints a config's "
         "resolved values with the same meanings.", ""]
  top = [(k, v) for k, v in flat_items(c) if "." not in k]
  sections = [k for k in descriptions() if hasattr(c.get(k), "items")]
  groups = [("Top level", "", top)] + [
      (f"`{s}`", known.get(s, ""), [(k, v) for k, v in flat_items(c) if k.startswith(s + ".")])
      for s in sections]
  for title, about, items in groups:
    out += [f"## {title}", ""]
    if about:
      out += [about[0].upper() + about[1:] + ".", ""]
    out += ["| key | default | meaning |", "|---|---|---|"]
    for key, value in items:
      meaning = known.get(key, "")
      if key in note:
        meaning = f"{meaning} (*{note[key]}*)" if meaning else note[key]
      out.append(f"| `{key}` | `{_cell(_value(value))}` | {_cell(meaning)} |")
    out.append("")
  return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxreplay.config.reference",
      description="Writes the configuration reference page from config/defaults.py's comments.")
  parser.add_argument("--out", default=PAGE, help=f"the Markdown file to write (default {PAGE})")
  parser.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when --out differs from the generated page")
  args = parser.parse_args(argv)
  missing = missing_descriptions()
  if missing:
    print(f"error: keys without a meaning in jaxreplay/config/defaults.py: {', '.join(missing)}; "
          "add a comment after each", file=sys.stderr)
    return 2
  text = markdown()
  if args.check:
    try:
      with open(args.out, encoding="utf-8") as f:
        current = f.read()
    except OSError:
      current = None
    if current != text:
      print(f"error: {args.out} is not current; regenerate it with `{COMMAND}`", file=sys.stderr)
      return 1
    return 0
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {args.out} ({len(list(flat_items(defaults.base_config())))} keys)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
