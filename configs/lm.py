"""A small GPT on a byte-level corpus of the Python standard library (offline, no download).

    python train.py --config configs/lm.py                       # FDG, K=4
    python train.py --config configs/lm.py --config.algorithm=bp --config.num_stages=1

The corpus (`fdg_jax.data.text`) is the standard library's own *.py files, every 10th file
held out for validation; tokens are bytes (vocabulary 256). The model is `gpt_tiny`'s shape
(token embedding, 4 causal pre-norm blocks of width 128 with 4 heads, head: 6 blocks), split
by cost. Evaluation reports the validation loss per token and its perplexity (metrics.jsonl:
test_loss, test_perplexity). On 2 CPU cores an epoch of the default 1 MB of text takes a few
minutes; `--config.text_max_bytes=0` uses the whole corpus (about 9 MB).
"""

import importlib.util
import pathlib


def _default():
  path = pathlib.Path(__file__).with_name("default.py")
  spec = importlib.util.spec_from_file_location("_fdg_config_default", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(arg: str | None = None):
  del arg
  c = _default()
  c.dataset = "stdlib_text"
  c.seq_len = 128              # tokens (bytes) per training window
  c.text_max_bytes = 1_000_000  # bytes of each split to use (0: all)
  c.model = "gpt"
  c.model_kwargs = {"seq_len": 128, "dim": 128, "depth": 4, "num_heads": 4}
  c.algorithm = "fdg"
  c.num_stages = 4
  c.split = "balanced"
  c.batch_size = 32
  c.eval_batch_size = 64
  c.num_epochs = 3
  c.optimizer = "adam"
  c.learning_rate = 1e-3
  c.momentum = 0.0
  c.weight_decay = 0.0
  c.lr_schedule = "cosine"
  c.warmup_epochs = 0.2
  c.log_every_steps = 50
  c.checkpoint_every_steps = 500
  return c
