"""Writes docs/configs.md: every field of configs/default.py with its default and comment.

The comments are read from the file itself (a field's comment is the text after `#` on its
line and on the lines that continue it), so the reference cannot drift from the config:
`tests/test_docs.py` checks that the written page is what this script writes now.
"""

import ast
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SOURCE = os.path.join(ROOT, "configs", "default.py")
TARGET = os.path.join(os.path.dirname(__file__), "configs.md")
_FIELD = re.compile(r"^\s*c\.(\w+)\s*=\s*(.*?)(?:\s+#\s?(.*))?$")
_MORE = re.compile(r"^\s+#\s?(.*)$")
_SECTION = re.compile(r"^\s*#\s+(.+)$")


def fields() -> list[tuple[str, str, str, str]]:
  """(section, name, default as written, comment) for every `c.name = ...` line."""
  out, section = [], ""
  lines = open(SOURCE).read().splitlines()
  for i, line in enumerate(lines):
    m = _FIELD.match(line)
    if not m:
      s = _SECTION.match(line)
      if s and line.startswith("  #") and not line.startswith("   "):
        section = s.group(1).rstrip(".")
      continue
    name, value, comment = m.group(1), m.group(2).strip(), (m.group(3) or "").strip()
    j = i + 1
    while j < len(lines) and _MORE.match(lines[j]) and not _FIELD.match(lines[j]) \
        and lines[j].startswith(" " * 10):
      comment += " " + _MORE.match(lines[j]).group(1).strip()
      j += 1
    out.append((section, name, value, comment))
  return out


def render() -> str:
  rows = ["# Config fields", "",
          "Every field of `configs/default.py` (the other configs start from it and change a few),",
          "set on the command line with `--config.FIELD=VALUE`. Generated from the file's own",
          "comments by `docs/gen_configs.py`.", ""]
  last = None
  for section, name, value, comment in fields():
    if section != last:
      rows += ["", f"## {section}", "", "| field | default | meaning |", "|---|---|---|"]
      last = section
    value = value.replace("|", "\\|")
    comment = comment.replace("|", "\\|")
    rows.append(f"| `{name}` | `{value}` | {comment} |")
  return "\n".join(rows) + "\n"


def write() -> None:
  text = render()
  if not os.path.exists(TARGET) or open(TARGET).read() != text:
    with open(TARGET, "w") as f:
      f.write(text)


if __name__ == "__main__":
  write()
  print(f"wrote {TARGET}")
