"""Sphinx configuration: `python -m sphinx -W -b html docs docs/_build/html`."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))

import gen_configs  # noqa: E402  (docs/configs.md, from configs/default.py's comments)

gen_configs.write()

project = "fdg_jax"
author = "the fdg_jax authors"
copyright = "2026, the fdg_jax authors"
extensions = ["myst_parser", "sphinx.ext.autodoc",
              "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build", "results/*.json"]
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "none"
autodoc_mock_imports = []
napoleon_google_docstring = True
html_theme = "furo" if __import__("importlib").util.find_spec("furo") else "alabaster"
html_title = "fdg_jax"
suppress_warnings = ["ref.python"]  # ref.python: a name two classes share
nitpicky = False
napoleon_use_ivar = True
default_role = "literal"  # docstrings mark code names with single backticks
