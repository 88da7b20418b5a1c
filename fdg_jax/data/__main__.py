"""``python -m fdg_jax.data --dataset NAME [--data_dir D]``: prints a dataset's info.

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
  parser.add_argument("--dataset", required=True, choices=registry.list_datasets())
  parser.add_argument("--data_dir", default=None,
                      help="TFDS data directory (fashion_mnist: or a folder of its IDX files)")
  args = parser.parse_args(argv)
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


if __name__ == "__main__":
  sys.exit(main())
