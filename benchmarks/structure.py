"""The library's structure in numbers: module and class sizes, import cycles, and where each
registered schedule's name appears.

    python benchmarks/structure.py [--names bp ddg fdg gpipe 1f1b]

Reads the source only (ast), nothing is imported. An import counts wherever it is written,
inside a function too (a lazy import that closes a cycle is still a cycle). Prints the
largest modules and classes (lines), every cycle of the import graph of `fdg_jax` (none
expected), and for each schedule name the files outside the registry, its factories, tests
and docs where it appears as a string literal.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fdg_jax"


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def imports(name: str, path: pathlib.Path, known: set) -> set:
  """The fdg_jax modules `name` imports, anywhere in its source."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # `from pkg import sub` imports the submodule; `from pkg import name` the package
      subs = {f"{base}.{a.name}" for a in node.names} & known
      found |= subs
      if len(subs) < len(node.names):
        found.add(base)
  out = set()
  for f in found:
    while f and f not in known:
      f = f.rpartition(".")[0]
    if f and f != name:
      out.add(f)
  return out


def cycles(graph: dict) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  sys.setrecursionlimit(10000)
  for v in graph:
    if v not in index:
      visit(v)
  return out


def sizes(mods: dict) -> tuple[list, list]:
  files, classes = [], []
  for name, path in mods.items():
    text = path.read_text()
    files.append((len(text.splitlines()), str(path.relative_to(ROOT))))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.ClassDef):
        classes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
  return sorted(files, reverse=True), sorted(classes, reverse=True)


def name_sites(names) -> dict[str, list[str]]:
  """Per name, the places of the library (fdg_jax/ and train.py) holding it as a whole
  string literal, but the registry's module (fdg_jax/plans.py). (Configs, benchmarks,
  tests and docs choose schedules by name, as users do: not counted.)"""
  paths = [ROOT / "train.py"] + sorted(PACKAGE.rglob("*.py"))
  out = {n: [] for n in names}
  for path in paths:
    rel = str(path.relative_to(ROOT))
    if rel == "fdg_jax/plans.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in out:
        out[node.value].append(f"{rel}:{node.lineno}")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--names", nargs="*", default=["bp", "ddg", "fdg", "gpipe", "1f1b"])
  parser.add_argument("--top", type=int, default=8)
  args = parser.parse_args(argv)
  mods = modules()
  graph = {n: imports(n, p, set(mods)) for n, p in mods.items()}
  files, classes = sizes(mods)
  print("largest modules (lines):")
  for n, f in files[:args.top]:
    print(f"  {n:5d}  {f}")
  print("largest classes (lines):")
  for n, c in classes[:args.top]:
    print(f"  {n:5d}  {c}")
  found = cycles(graph)
  print(f"import cycles (lazy imports included): {len(found)}")
  for c in found:
    print("  " + " <-> ".join(c))
  print("where each schedule's name appears as a string in the library (fdg_jax/, train.py), "
        "outside its registry fdg_jax/plans.py:")
  for name, sites in name_sites(args.names).items():
    print(f"  {name!r}: {len(sites)}" + (f"  ({', '.join(sites)})" if sites else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
