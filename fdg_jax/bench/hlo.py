"""What a compiled program runs per loop iteration, read off its optimised HLO text.

XLA:CPU runs every instruction of a loop body that is not pure bookkeeping (a parameter,
constant, tuple, tuple element or bitcast) as its own kernel, so their number per iteration
is a first measure of a tick's fixed cost on CPU, beside the bytes it moves.

    text = jax.jit(f).lower(*args).compile().as_text()
    loop_kernels(text)  # Counter({'fusion': 99, 'dot': 5})

A conditional is one kernel more, plus the kernels of the branch it runs.
"""

from __future__ import annotations

import collections

BOOKKEEPING = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})


def computations(text: str) -> dict[str, list[str]]:
  """Each computation of an HLO module's text: name -> its instruction lines."""
  out: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    if not line.strip() or line.startswith(("HloModule", "//")):
      continue
    if not line[0].isspace():  # a computation's header, or the "}" that closes it
      if line.startswith("}"):
        current = None
        continue
      words = line.split()
      name = words[1] if words[0] == "ENTRY" else words[0]
      current = out.setdefault(("ENTRY " if words[0] == "ENTRY" else "") + name.lstrip("%"),
                               [])
      continue
    if current is not None:
      current.append(line.strip())
  return out


def opcode(instruction: str) -> str:
  """The opcode of one instruction line, `[ROOT ]%name = TYPE opcode(operands), ...`."""
  rest = instruction.split(" = ", 1)[1]
  depth, i = 0, 0
  while i < len(rest):  # skip the type: a shape, or a tuple of shapes (with /*index*/ notes)
    c = rest[i]
    if rest.startswith("/*", i):
      i = rest.index("*/", i) + 2
      continue
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == " " and depth == 0:
      break
    i += 1
  return rest[i:].lstrip().split("(", 1)[0]


def loop_body(text: str) -> str:
  """The name of the body of the entry computation's loop (the largest, if several)."""
  comps = computations(text)
  entry = next(lines for name, lines in comps.items() if name.startswith("ENTRY "))
  bodies = [line.split("body=", 1)[1].split(",", 1)[0].split()[0].lstrip("%")
            for line in entry if opcode(line) == "while"]
  if not bodies:
    raise ValueError("the entry computation has no loop")
  return max(bodies, key=lambda b: len(comps[b]))


def branches(instruction: str) -> list[str]:
  """The branch computations of a `conditional` instruction line (else [])."""
  if "branch_computations={" in instruction:
    names = instruction.split("branch_computations={", 1)[1].split("}", 1)[0].split(",")
  else:
    names = [instruction.split(key, 1)[1].split(",", 1)[0].split("}", 1)[0]
             for key in ("true_computation=", "false_computation=") if key in instruction]
  return [n.strip().lstrip("%") for n in names]


def kernels(comps: dict[str, list[str]], name: str) -> collections.Counter:
  """Opcode counts of the instructions computation `name` runs as kernels. A conditional
  counts as one, plus the kernels of its largest branch (a tick past the pipeline fill runs
  the branch with all of a stage's work)."""
  counts = collections.Counter()
  for line in comps[name]:
    op = opcode(line)
    if op in BOOKKEEPING:
      continue
    counts[op] += 1
    if op == "conditional":
      counts += max((kernels(comps, b) for b in branches(line)),
                    key=lambda c: sum(c.values()), default=collections.Counter())
  return counts


def loop_kernels(text: str) -> collections.Counter:
  """Opcode counts of the instructions one iteration of the entry's loop runs as kernels
  (see `kernels`)."""
  return kernels(computations(text), loop_body(text))
