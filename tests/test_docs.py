"""The documentation's examples run as written, and its generated pages are current.

Every ```python block of README.md and docs/*.md runs in a fresh process (once on one CPU
device, as on a laptop, and once on 4), from a temporary directory, each on its own, as a
reader would paste it.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


def test_there_are_examples_to_run():
  assert {p.name for p, _, _ in BLOCKS} >= {"README.md", "getting_started.md"}


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("page,index,code", BLOCKS,
                         ids=[f"{p.name}:{i}" for p, i, _ in BLOCKS])
def test_python_block_runs_as_written(page, index, code, devices, tmp_path):
  script = tmp_path / "example.py"
  script.write_text(code)
  env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "JAX_PLATFORMS": "cpu", "FDG_JAX_COMPILATION_CACHE": "off", "PATH": "/usr/bin:/bin"}
  p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=240)
  assert p.returncode == 0, f"{page.name} block {index}:\n{p.stderr[-3000:]}"


def test_the_config_reference_is_generated_from_the_config():
  sys.path.insert(0, str(ROOT / "docs"))
  import gen_configs
  assert (ROOT / "docs" / "configs.md").read_text() == gen_configs.render()
  documented = {name for _, name, _, _ in gen_configs.fields()}
  spec = __import__("importlib.util").util.spec_from_file_location(
      "cfg", ROOT / "configs/default.py")
  module = __import__("importlib.util").util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert documented == set(module.get_config().keys())
  assert all(comment for _, _, _, comment in gen_configs.fields())  # every field explained


HEADLINE_PAGES = ("staleness.md", "results.md")
_MARKER = re.compile(r"^<!-- python benchmarks/delay_robust.py (.*) -->$", re.M)


def _headline_commands() -> list[str]:
  found = {m.group(1) for page in HEADLINE_PAGES
           for m in _MARKER.finditer((ROOT / "docs" / page).read_text())}
  return sorted(found)


def test_the_docs_quote_the_study_headlines_of_every_part():
  commands = _headline_commands()
  for part in ("--part mlp --report", "--part vit --report", "--part gpt --gpt_epochs 3"):
    assert any(c.startswith(part) for c in commands), part
  assert len(commands) == 5  # and the MLP at widths 64 and 128


@pytest.mark.parametrize("args", _headline_commands())
def test_the_staleness_headlines_are_what_the_study_prints_from_its_json(args):
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "delay_robust.py"),
                        *args.split()], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  block = out.stdout.strip()
  assert block.startswith(f"<!-- python benchmarks/delay_robust.py {args} -->")
  assert "Headline:" in block
  for page in HEADLINE_PAGES:  # every page that quotes it, word for word
    text = (ROOT / "docs" / page).read_text()
    if block.splitlines()[0] in text:
      assert block in text, page


# Lines that are data quoted as it is (a log line a test parses), not code or prose.
LONG_DATA_LINES = {"tests/test_peers.py": {"SAMPLE_LOST_1"}}


def _python_files() -> list[str]:
  """The repository's Python files: git's list, or (no git checkout) a walk that skips what
  is not the project's (virtual environments, build output, runs)."""
  try:
    return subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", ".ci-venv", "runs", "_build", "build", "__pycache__", ".eggs"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
            if not skip & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def test_python_lines_are_at_most_100_columns():
  files = _python_files()
  assert "fdg_jax/__init__.py" in files
  long = [f"{name}:{i}" for name in files
          for i, line in enumerate((ROOT / name).read_text().splitlines(), 1)
          if len(line) > 100
          and not any(line.startswith(d) for d in LONG_DATA_LINES.get(name, ()))]
  assert not long, long


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(path: pathlib.Path) -> list[str]:
  """The relative link targets of a Markdown page or of a notebook's Markdown cells."""
  if path.suffix == ".ipynb":
    import json
    cells = json.loads(path.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
  else:
    text = path.read_text()
  return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("page", PAGES + sorted((ROOT / "notebooks").glob("*.ipynb")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_of_the_repository(page):
  missing = _missing_links(page)
  assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def _missing_links(page: pathlib.Path) -> list[str]:
  return [t for t in _relative_links(page) if not (page.parent / t.split("#")[0]).exists()]


def test_the_link_check_sees_links_and_a_broken_one(tmp_path):
  page = tmp_path / "p.md"
  page.write_text("see [a](a.md), [web](https://x.org), [here](#top) and [b](sub/b.md#x)\n")
  (tmp_path / "a.md").write_text("")
  assert _relative_links(page) == ["a.md", "sub/b.md#x"]
  assert _missing_links(page) == ["sub/b.md#x"]


def test_no_file_cites_a_spec_outside_the_repository():
  """The specification of the tick orders is docs/algorithms.md, inside the repository."""
  files = [ROOT / "README.md", ROOT / "train.py"] + [
      p for d in ("fdg_jax", "tests", "docs", "notebooks", "benchmarks", "configs")
      for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
  cited = [str(p.relative_to(ROOT)) for p in files if p.name != "test_docs.py"
           and "ALGORITHMS.md" in p.read_text(errors="ignore")]
  assert not cited, cited
  assert (ROOT / "docs" / "algorithms.md").exists()


@pytest.mark.parametrize("name", ["bench_cores_cpu", "bench_cores_split5_cpu"])
def test_the_bench_cores_table_is_what_its_json_prints(name):
  marker = ("<!-- bench cores: written by `python -m fdg_jax.bench cores --report "
            f"docs/results/{name}.json` -->")
  text = (ROOT / "docs" / "benchmarks.md").read_text()
  assert marker in text
  out = subprocess.run([sys.executable, "-m", "fdg_jax.bench", "cores", "--report",
                        f"docs/results/{name}.json"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  assert marker + "\n" + out.stdout.strip() + "\n" in text


def test_the_readme_results_table_is_generated_from_the_records():
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_table.py")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  block = out.stdout.strip()
  assert block.startswith("<!-- results table: written by")
  readme = (ROOT / "README.md").read_text()
  assert block in readme, "README's results table differs from benchmarks/results_table.py"
  # Its first sentences: whether any delayed schedule matched BP, and the measured speed-up.
  first = block.splitlines()[1]
  assert first.startswith(("No delayed schedule has yet", "Delayed schedules that ended"))
  assert "Measured speed-up" in first or "No speed-up has been measured" in first
