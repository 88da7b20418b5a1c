"""``python -m fdg_jax.data --dataset NAME [--data_dir D]``: prints a dataset's info.

``python -m fdg_jax.data --dataset stdlib_text --split SPLIT --files`` lists the files a
split of the text corpus holds, one a line (splits: train, validation, held_out,
train_rest; see ``fdg_jax.data.text``).

If the dataset is not prepared, prints the one-line ``DatasetNotFoundError`` message to
stderr and exits with status 1 (no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
  """Runs the CLI; returns the exit status (0 ok, 1 dataset missing, 2 bad arguments)."""
  from fdg_jax.data import registry  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m fdg_jax.data", description=__doc__)
  from fdg_jax.data import text  # pylint: disable=g-import-not-at-top
  parser.add_argument("--dataset", required=True,
                      choices=registry.list_datasets() + ["stdlib_text"])
  parser.add_argument("--data_dir", default=None,
                      help="TFDS data directory (fashion_mnist: or a folder of its IDX files)")
  parser.add_argument("--split", default=None, choices=text.SPLITS,
                      help="stdlib_text: the split to describe")
  parser.add_argument("--files", action="store_true",
                      help="stdlib_text: list the split's files, one a line")
  args = parser.parse_args(argv)
  if args.dataset == "stdlib_text":
    return _text(args)
  if args.files or args.split:
    parser.error("--split and --files describe the text corpus: use --dataset stdlib_text")
  # TFDS logs warnings (e.g. a missing dataset_info.json) through absl; keep stderr clean.
  logging.getLogger("absl").setLevel(logging.ERROR)
  try:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:
    pass
  from fdg_jax.data import sources  # pylint: disable=g-import-not-at-top
  spec = registry.get_spec(args.dataset)
  try:
    loaded = {s: sources.load(spec.name, s, args.data_dir, cache=False) for s in spec.splits}
  except sources.DatasetNotFoundError as err:
    print(err, file=sys.stderr)
    return 1
  sizes = {s: ds.num_examples for s, ds in loaded.items()}
  origins = {ds.origin for ds in loaded.values()} - {None}
  print(f"dataset:      {spec.name} ({'idx' if origins else spec.source})")
  if origins:
    print(f"files:        {', '.join(sorted(origins))}")
  elif spec.source == "tfds":
    print(f"data_dir:     {sources.resolve_data_dir(args.data_dir)}")
  for split, n in sizes.items():
    print(f"{split + ':':<13} {n} examples (source split '{spec.source_split(split)}')")
  print(f"num_classes:  {spec.num_classes}")
  print(f"image_shape:  {tuple(spec.image_shape)}")
  print(f"mean:         {tuple(spec.mean)}")
  print(f"std:          {tuple(spec.std)}")
  print(f"augmentation: {spec.augmentation}")
  return 0


def _text(args) -> int:
  """The text corpus: a split's files (--files), or each split's files and bytes."""
  import os  # pylint: disable=g-import-not-at-top
  from fdg_jax.data import text  # pylint: disable=g-import-not-at-top
  root = text.stdlib_dir()
  files = text.corpus_files(root)
  splits = [args.split] if args.split else list(text.SPLITS)
  if args.files:
    for split in splits:
      for f in text.split_files(files, split, root):
        print(f)
    return 0
  print(f"dataset:      stdlib_text (the *.py files under {root}, Python "
        f"{text.platform.python_version()})")
  for split in splits:
    fs = text.split_files(files, split, root)
    size = sum(os.path.getsize(os.path.join(root, f)) for f in fs)
    tops = len({text.top_level(f) for f in fs})
    print(f"{split + ':':<13} {len(fs)} files, {size:,} bytes, {tops} top-level packages or "
          "modules")
  return 0


if __name__ == "__main__":
  sys.exit(main())
