"""mkdocs hooks (`hooks:` in mkdocs.yml): the docs site built from the repository's own files.

Pages are written to read right on GitHub too; this file maps them onto the site:
- Includes: a region `<!-- include: PATH [shift=N] -->` ... `<!-- end include -->` in a page is
  replaced by the file PATH (relative to the page, e.g. `../EXPERIMENTS.md`), its headings moved
  down N levels; the region's own text is what GitHub shows instead (a link to the file). The
  README, EXPERIMENTS.md and WORKSPACE.md stay the one source of their text.
- Links are written as on GitHub, relative to the file that holds them; each is mapped to the site:
  a page under docs/ to its page, an included file to the page that includes it (`PAGE_OF`), a
  figure (`ASSET_GLOBS`) to its copy in the site, kept under its repository path. A link mkdocs
  cannot resolve stays as written, so `mkdocs build --strict` fails on it.
- Reserved pages (`RESERVED`): pages other branches write. While one is absent its nav entry is
  dropped and links to it become plain text; once it exists it is built like any page.
- Lists and tables after a paragraph, and lists nested by 2 spaces, are read as GitHub reads them
  (`gfm_blocks`).
- Stale paths: every code span that names a repository path (`configs/tiny.py`,
  `jaxreplay/run/pipeline.py`, `tests/x.py::test`) or a `jaxreplay.` module must exist, else a
  warning (an error under --strict). tests/test_docs.py runs the same check over README.md.
"""
from __future__ import annotations

import glob
import logging
import os
import posixpath
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = "docs"
# Repository files outside docs/ that a page includes, and the site page that holds each.
PAGE_OF = {
    "README.md": "index.md",
    "EXPERIMENTS.md": "experiments.md",
    "WORKSPACE.md": "architecture.md",
}
# Figures the pages link to, copied into the site under their repository paths.
ASSET_GLOBS = ("experiments/figures/*.png", "bench/results/*.png", "bench/results/*/*.png")
# Pages written on other branches: site path -> who writes it.
RESERVED: dict[str, str] = {}  # every page has landed
# First path components a code span must start with to be checked as a repository path; a layer
# name alone (`rollout/vllm/direct_load.py`) is read under jaxreplay/.
ROOTS = ("jaxreplay", "tests", "bench", "configs", "launch", "assets", "experiments", "docs", ".ci")
LAYERS = ("config", "models", "tasks", "learner", "data", "rollout", "run", "infra", "science")
TOP_FILES = ("README.md", "WORKSPACE.md", "EXPERIMENTS.md", "pyproject.toml", "mkdocs.yml",
             "install.sh")

log = logging.getLogger("mkdocs.hooks.jaxreplay")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"(!?\[(?:[^\]\[]|\[[^\]]*\])*\])\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")
_INCLUDE = re.compile(
    r"^<!-- include: (\S+)(?: shift=(\d))? -->\n.*?^<!-- end include -->[ \t]*$", re.M | re.S)
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.\-/]+(::[A-Za-z0-9_\[\]\-.]+)?$")
_MODULE = re.compile(r"^jaxreplay(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def split_code(markdown: str) -> list[tuple[bool, str]]:
  """The markdown cut into (is_code, text) pieces: fenced blocks and code spans are code."""
  pieces, last = [], 0
  for fence in _FENCE.finditer(markdown):
    pieces += _split_spans(markdown[last:fence.start()]) + [(True, fence.group(0))]
    last = fence.end()
  return pieces + _split_spans(markdown[last:])


def _split_spans(text: str) -> list[tuple[bool, str]]:
  pieces, last = [], 0
  for span in _SPAN.finditer(text):
    pieces += [(False, text[last:span.start()]), (True, span.group(0))]
    last = span.end()
  return pieces + [(False, text[last:])]


def repo_path(token: str) -> str | None:
  """The repository path a token names, or None when it does not look like one."""
  token = token.split("::")[0].rstrip("/")
  if not _PATHLIKE.match(token) or token.startswith(("/", "..")):
    return None
  first = token.split("/")[0]
  if first in ROOTS or (first in TOP_FILES and "/" not in token):
    return token
  if first in LAYERS and "/" in token and token.endswith(".py"):
    return "jaxreplay/" + token
  return None


def _basenames(root: str) -> set[str]:
  """Names of the repository's .py / .sh files (a bare `buffer.py` must name one of them)."""
  names = set()
  for top in ROOTS:
    for _, dirs, found in os.walk(os.path.join(root, top)):
      dirs[:] = [d for d in dirs if d not in ("runs", "__pycache__")]
      names.update(found)
  return names


def module_missing(name: str, root: str = ROOT) -> bool:
  """Whether `jaxreplay.a.b.attr` names no module: every part up to the first one that is not a
  package or module must lead to a module (the rest are attributes of it)."""
  path = root
  for part in name.split("."):
    if os.path.isdir(os.path.join(path, part)):
      path = os.path.join(path, part)
    elif os.path.isfile(os.path.join(path, part + ".py")):
      return False
    else:
      return not os.path.isfile(path + ".py") and os.path.isdir(path)
  return False


def missing_paths(markdown: str, root: str = ROOT) -> list[str]:
  """Code spans of `markdown` that name a repository path or jaxreplay module that does not exist."""
  missing, basenames = [], None
  for is_code, text in split_code(markdown):
    if not is_code or text.startswith(("```", "~~~")):
      continue
    token = text.strip("`").strip()
    if token.startswith("python -m "):
      token = token.split()[2]
    path = repo_path(token)
    if path is not None:
      if not os.path.exists(os.path.join(root, path)):
        missing.append(token)
    elif _MODULE.match(token) and module_missing(token, root):
      missing.append(token)
    elif re.match(r"^[A-Za-z0-9_]+\.(py|sh)$", token):
      basenames = basenames or _basenames(root)
      if token not in basenames:
        missing.append(token)
  return missing


def site_path(repo_file: str) -> str | None:
  """Where a repository file is in the site: docs/x.md -> x.md, an included file -> its page, an
  asset -> its own path; None for anything else."""
  if repo_file.startswith(DOCS + "/"):
    return repo_file[len(DOCS) + 1:]
  if repo_file in PAGE_OF:
    return PAGE_OF[repo_file]
  if any(_matches(repo_file, pattern) for pattern in ASSET_GLOBS):
    return repo_file
  return None


def _matches(path: str, pattern: str) -> bool:
  return path.count("/") == pattern.count("/") and glob.fnmatch.fnmatch(path, pattern)


def rewrite_links(markdown: str, source: str, page: str, root: str = ROOT) -> str:
  """Links of `markdown` (held by repository file `source`) made relative to site page `page`;
  links to an absent reserved page become their text."""
  source_dir = posixpath.dirname(source)

  def one(match: re.Match) -> str:
    label, target, title = match.groups()
    if re.match(r"^[a-z]+:|^#", target):
      return match.group(0)
    path, _, anchor = target.partition("#")
    repo_file = posixpath.normpath(posixpath.join(source_dir, path))
    site = site_path(repo_file)
    if site is None:
      return match.group(0)
    if site in RESERVED and not os.path.exists(os.path.join(root, DOCS, site)):
      return label[1:-1] if not label.startswith("!") else ""
    new = posixpath.relpath(site, posixpath.dirname(page) or ".")
    return f"{label}({new}{'#' + anchor if anchor else ''}{title})"

  return "".join(text if is_code else _LINK.sub(one, text) for is_code, text in split_code(markdown))


def shift_headings(markdown: str, levels: int) -> str:
  return "".join(
      text if is_code else re.sub(r"^(#{1,6}) ", lambda m: "#" * min(6, len(m.group(1)) + levels)
                                  + " ", text, flags=re.M)
      for is_code, text in split_code(markdown))


def gfm_blocks(markdown: str) -> str:
  """Lists and tables as GitHub reads them: Python-Markdown needs a blank line before a list or a
  table that follows a paragraph, and 4 spaces to nest a list item (GitHub takes 2)."""

  def one(text: str) -> str:
    out = []
    for line in text.split("\n"):
      previous = out[-1] if out else ""
      item = re.match(r"^([-*+]|\d+\.) ", line)
      if re.match(r"^  ([-*+]|\d+\.) ", line):
        line = "  " + line
      elif previous.strip() and not previous.startswith((" ", "\t")) and (
          (item and not re.match(r"^([-*+]|\d+\.) ", previous)) or
          (line.startswith("|") and not previous.startswith("|"))):
        out.append("")
      out.append(line)
    return "\n".join(out)

  pieces, last = [], 0
  for fence in _FENCE.finditer(markdown):
    pieces += [one(markdown[last:fence.start()]), fence.group(0)]
    last = fence.end()
  return "".join(pieces + [one(markdown[last:])])


def expand_includes(markdown: str, source: str, page: str, root: str = ROOT) -> str:
  """Include regions of `markdown` (held by `source`) replaced by their files, links mapped."""

  def one(match: re.Match) -> str:
    included = posixpath.normpath(posixpath.join(posixpath.dirname(source), match.group(1)))
    with open(os.path.join(root, included), encoding="utf-8") as f:
      text = f.read()
    text = rewrite_links(text, included, page, root)
    return shift_headings(text, int(match.group(2) or 0))

  return _INCLUDE.sub(one, markdown)


def drop_reserved(nav, root: str = ROOT):
  """The nav without the entries of reserved pages that do not exist yet."""
  if isinstance(nav, list):
    kept = [drop_reserved(item, root) for item in nav]
    return [item for item in kept if item not in (None, {}, [])]
  if isinstance(nav, dict):
    return {k: v for k, v in ((k, drop_reserved(v, root)) for k, v in nav.items())
            if v not in (None, {}, [])}
  if nav in RESERVED and not os.path.exists(os.path.join(root, DOCS, nav)):
    return None
  return nav


# mkdocs events.

def on_config(config):
  if config.nav:
    config.nav = drop_reserved(config.nav)
  return config


def on_files(files, config):
  from mkdocs.structure.files import File  # pylint: disable=g-import-not-at-top
  for pattern in ASSET_GLOBS:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      uri = os.path.relpath(path, ROOT).replace(os.sep, "/")
      if files.get_file_from_path(uri) is None:
        files.append(File.generated(config, uri, abs_src_path=path))
  return files


def on_page_markdown(markdown, page, config, files):
  source = f"{DOCS}/{page.file.src_uri}"
  markdown = expand_includes(markdown, source, page.file.src_uri)
  markdown = gfm_blocks(rewrite_links(markdown, source, page.file.src_uri))
  for token in missing_paths(markdown):
    log.warning("%s: `%s` names no file or module of the repository (stale path?)",
                page.file.src_uri, token)
  return markdown
