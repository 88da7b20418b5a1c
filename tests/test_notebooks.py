"""The notebooks run top to bottom (tiny, FDG_NOTEBOOK_SMALL=1) and are committed with the
outputs of a full CPU run (`python notebooks/execute.py`).

Each notebook is executed with nbclient in a fresh "python3" kernel whose working directory
is notebooks/. The kernel inherits this process's environment (conftest's XLA_FLAGS: four
CPU devices, fast compiles) plus FDG_NOTEBOOK_SMALL=1 and JAX_PLATFORMS=cpu.
"""

import base64
import json
import pathlib
import re

import numpy as np
import pytest

from fdg_jax import viz

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "staleness.ipynb")
PNG_MAGIC = b"\x89PNG"


def execute(name: str, monkeypatch) -> nbformat.NotebookNode:
  monkeypatch.setenv("FDG_NOTEBOOK_SMALL", "1")
  # CPU, like the rest of the suite (conftest): on a GPU machine, kernels of parallel test
  # workers would otherwise each preallocate most of the GPU's memory.
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  return nb


def outputs(nb):
  """(all stdout text, decoded PNG images, markdown outputs) of an executed notebook."""
  text, images, markdown = [], [], []
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    for out in cell.outputs:
      assert out.output_type != "error", f"{out.ename}: {out.evalue}"
      if out.output_type == "stream" and out.name == "stdout":
        text.append(out.text)
      data = out.get("data", {})
      if "image/png" in data:
        images.append(base64.b64decode(data["image/png"]))
      if "text/markdown" in data:
        markdown.append(data["text/markdown"])
  return "".join(text), images, markdown


def accuracies(text: str, pattern: str) -> dict[str, float]:
  return {m.group(1).strip(): float(m.group(2)) for m in re.finditer(pattern, text)}


def test_quickstart_runs(monkeypatch):
  text, images, _ = outputs(execute("quickstart.ipynb", monkeypatch))
  assert "small run" in text
  acc = accuracies(text, r"(?m)^(BP|FDG) K=4: test accuracy ([0-9.]+)")
  assert set(acc) == {"BP", "FDG"}, text
  assert all(0.0 <= a <= 1.0 for a in acc.values()), acc
  assert "delays (6, 4, 2, 0)" in text  # FDG's delays at K=4
  # The learning curves and the prediction strip are figures.
  assert len(images) >= 2 and all(im.startswith(PNG_MAGIC) for im in images)
  # CIFAR-10: either trained (when prepared locally) or skipped with the one-line message.
  if "CIFAR-10 skipped:" in text:
    line = next(l for l in text.splitlines() if l.startswith("CIFAR-10 skipped:"))
    assert "cifar10" in line and "tfds build" in line
  else:
    cifar = accuracies(text, r"(?m)^CIFAR-10 (.+?) K=4: test accuracy ([0-9.]+)")
    assert len(cifar) == 2 and all(0.0 <= a <= 1.0 for a in cifar.values()), text


def test_staleness_runs(monkeypatch):
  text, images, markdown = outputs(execute("staleness.ipynb", monkeypatch))
  assert "the recorded ticks agree with docs/algorithms.md for bp, ddg, fdg" in text
  assert "fdg: delays (6, 4, 2, 0)" in text and "ddg: delays (3, 2, 1, 0)" in text
  # The delay table: one row per stage, declared and measured delays side by side.
  assert markdown and markdown[0].count("(measured ") == 3 * 4
  acc = accuracies(text, r"(?m)^(BP|FDG beta=[0-9.]+)\s+K=4: final test accuracy ([0-9.]+)")
  assert set(acc) == {"FDG beta=1", "FDG beta=0.5", "FDG beta=0.2"}, text  # small: no BP
  assert all(0.0 <= a <= 1.0 for a in acc.values()), acc
  # The space-time diagram and the beta curves.
  assert len(images) >= 2 and all(im.startswith(PNG_MAGIC) for im in images)


@pytest.mark.parametrize("name", NAMES)
def test_committed_with_the_outputs_of_a_full_run(name):
  """The committed notebook reads as a worked example: every code cell ran, in order, in one
  full (not tiny) run without an error (`python notebooks/execute.py` writes them)."""
  nb = json.loads((NOTEBOOKS / name).read_text())
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert code
  assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
  outputs = [o for c in code for o in c["outputs"]]
  assert not [o for o in outputs if o["output_type"] == "error"]
  text = "".join("".join(o.get("text", "")) for o in outputs if o["output_type"] == "stream")
  assert "full run" in text and "small run" not in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # its figures are there
  parameters = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(parameters) == 1 and "SMALL = False" in "".join(parameters[0]["source"])
  assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_measured_delays():
  forward = np.array([[0, -1], [1, 0], [2, 1], [3, 2]])
  update = np.array([[-1, -1], [-1, 0], [0, 1], [1, 2]])
  assert viz.Trace("fdg", forward, update).measured_delays() == (2, 0)
  assert viz.Trace("fdg", forward, np.full_like(update, -1)).measured_delays() == (None, None)
  uneven = np.array([[-1, -1], [-1, 0], [0, 1], [2, 2]])
  with pytest.raises(ValueError, match="varies"):
    viz.Trace("fdg", forward, uneven).measured_delays()
