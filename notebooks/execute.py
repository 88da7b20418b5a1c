"""Runs each notebook top to bottom in a fresh kernel (a full CPU run) and saves its outputs.

    python notebooks/execute.py [quickstart.ipynb staleness.ipynb]

The committed notebooks carry the outputs of this run, so that they read as a worked example
before anyone runs them; `tests/test_notebooks.py` runs them again (tiny) and checks that
the saved outputs come from a full run without errors.
"""

import os
import pathlib
import sys

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent


def execute(name: str) -> None:
  path = HERE / name
  nb = nbformat.read(path, as_version=4)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FDG_NOTEBOOK_SMALL")}
  os.environ.clear()
  os.environ.update(env, JAX_PLATFORMS="cpu")
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=1800,
                                   resources={"metadata": {"path": str(HERE)}})
  client.execute()
  for cell in nb.cells:  # the kernel's own bookkeeping, not the notebook's content
    cell.get("metadata", {}).pop("execution", None)
  nbformat.write(nb, path)
  print(f"executed {name}")


if __name__ == "__main__":
  for name in sys.argv[1:] or ["quickstart.ipynb", "staleness.ipynb"]:
    execute(name)
