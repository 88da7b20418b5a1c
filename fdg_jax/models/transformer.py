"""Transformers written as block sequences: a ViT classifier and a decoder-only GPT.

Both are [embed, layer0, ..., layer{depth-1}, head]: every transformer layer is one block, so
any layer boundary (and the boundaries next to the embedding and the head) can be a stage
boundary. The layers are pre-norm:

    x = x + Dropout(MultiHeadSelfAttention(LayerNorm(x)))     (causal in the GPT)
    x = x + Dropout(Dense(GELU(Dense(LayerNorm(x)))))         (hidden width mlp_ratio * dim)

    vit = fdg_jax.models.create("vit", num_classes=10, input_shape=(8, 8, 1), patch_size=2)
    gpt = fdg_jax.models.create("gpt", num_classes=256, seq_len=128, depth=4)  # vocab 256

`vit` takes float images [B, H, W, C] and returns logits [B, num_classes]. `gpt` takes int
tokens [B, T] (T <= seq_len) and returns next-token logits [B, T, vocab]; its `num_classes`
IS the vocabulary size (default 256: bytes), and its `Model.input_dtype` is "int32", so
`model.example_input(b)` is a token batch. `lm_loss` is the matching token cross-entropy.

Tied embeddings are not supported (`tie_embeddings=True` raises ValueError): the embedding is
the first block and the head the last, and any split into K >= 2 stages puts them in different
stages, which own disjoint parameters and are updated at different delays; the cost and
parameter analysis of `fdg_jax.partition` also builds every block on its own. The untied head
costs vocab * dim extra parameters (65k for vocab 256, dim 256).
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import optax

from fdg_jax.models.base import Model

_EMBED_INIT = nn.initializers.normal(stddev=0.02)


class TransformerLayer(nn.Module):
  """One pre-norm layer: self-attention and a GELU MLP, each in a residual branch."""

  dim: int
  num_heads: int
  mlp_ratio: float = 4.0
  dropout: float = 0.0
  causal: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    deterministic = not train
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.bool_)) if self.causal else None
    h = nn.LayerNorm(name="ln_attn")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.dim, out_features=self.dim,
        dropout_rate=self.dropout, deterministic=deterministic, name="attn")(h, mask=mask)
    x = x + nn.Dropout(self.dropout)(h, deterministic=deterministic)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(int(self.mlp_ratio * self.dim), name="fc1")(h))
    h = nn.Dense(self.dim, name="fc2")(h)
    return x + nn.Dropout(self.dropout)(h, deterministic=deterministic)


class PatchEmbed(nn.Module):
  """Non-overlapping patches (a conv with stride = patch size), an optional class token, a
  learned position embedding and dropout: [B, H, W, C] -> [B, N, dim]."""

  patch_size: int
  dim: int
  num_patches: int
  class_token: bool = False
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    p = self.patch_size
    if x.ndim != 4 or x.shape[1] % p or x.shape[2] % p:
      raise ValueError(f"ViT patch embedding needs images [B, H, W, C] with H and W "
                       f"divisible by patch_size={p}; got shape {x.shape}")
    x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", name="proj")(x)
    x = x.reshape(x.shape[0], -1, self.dim)
    if x.shape[1] != self.num_patches:
      raise ValueError(f"the model was built for {self.num_patches} patches, the input has "
                       f"{x.shape[1]}; build it with this input_shape")
    if self.class_token:
      cls = self.param("cls", nn.initializers.zeros, (1, 1, self.dim))
      x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.dim)).astype(x.dtype),
                           x], axis=1)
    pos = self.param("pos", _EMBED_INIT, (1, x.shape[1], self.dim))
    return nn.Dropout(self.dropout)(x + pos, deterministic=not train)


class ClassifierHead(nn.Module):
  """Final LayerNorm, pooling (class token or mean over tokens) and a dense classifier."""

  num_classes: int
  pool: str = "mean"

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    x = nn.LayerNorm(name="ln")(x)
    x = x[:, 0] if self.pool == "cls" else jnp.mean(x, axis=1)
    return nn.Dense(self.num_classes, name="dense")(x)


class TokenEmbed(nn.Module):
  """Token embedding plus a learned position embedding, then dropout: [B, T] int -> [B, T, dim]."""

  vocab_size: int
  dim: int
  seq_len: int
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"GPT takes integer tokens [B, T]; got {x.dtype} of shape {x.shape}")
    if x.shape[1] > self.seq_len:
      raise ValueError(f"sequence of {x.shape[1]} tokens exceeds the model's seq_len "
                       f"{self.seq_len}")
    h = nn.Embed(self.vocab_size, self.dim, embedding_init=_EMBED_INIT, name="tokens")(x)
    pos = self.param("pos", _EMBED_INIT, (self.seq_len, self.dim))
    return nn.Dropout(self.dropout)(h + pos[:x.shape[1]], deterministic=not train)


class LMHead(nn.Module):
  """Final LayerNorm and the (untied) projection to vocabulary logits: [B, T, vocab]."""

  vocab_size: int

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    return nn.Dense(self.vocab_size, name="dense")(nn.LayerNorm(name="ln")(x))


def _check_dims(dim, num_heads, depth, mlp_ratio, dropout):
  if dim <= 0 or num_heads <= 0 or dim % num_heads:
    raise ValueError(f"dim={dim} must be a positive multiple of num_heads={num_heads}")
  if depth < 0:
    raise ValueError(f"depth must be >= 0, got {depth}")
  if mlp_ratio <= 0 or int(mlp_ratio * dim) < 1:
    raise ValueError(f"mlp_ratio must be positive, got {mlp_ratio}")
  if not 0.0 <= dropout < 1.0:
    raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def vit(num_classes: int = 10, *, input_shape: Sequence[int] = (32, 32, 3), patch_size: int = 4,
        dim: int = 192, depth: int = 6, num_heads: int = 3, mlp_ratio: float = 4.0,
        dropout: float = 0.0, pool: str = "mean", name: str = "vit") -> Model:
  """Vision transformer: blocks [embed, layer0..layer{depth-1}, head].

  Args:
    num_classes: classes of the head.
    input_shape: (H, W, C) of the images; H and W divisible by patch_size (digits: (8, 8, 1)
      with patch_size 2 -> 16 tokens; CIFAR: (32, 32, 3) with patch_size 4 -> 64 tokens).
    patch_size, dim, depth, num_heads, mlp_ratio: the usual ViT sizes (dim % num_heads == 0).
    dropout: rate after the embedding, on the attention weights and on both residual branches.
    pool: "mean" (mean of the final tokens, no class token) or "cls" (a learned class token
      prepended by the embedding, read by the head).
  """
  input_shape = tuple(int(s) for s in input_shape)
  _check_dims(dim, num_heads, depth, mlp_ratio, dropout)
  if pool not in ("mean", "cls"):
    raise ValueError(f"pool must be 'mean' or 'cls', got {pool!r}")
  if len(input_shape) != 3 or patch_size <= 0 or input_shape[0] % patch_size \
      or input_shape[1] % patch_size:
    raise ValueError(f"input_shape {input_shape} must be (H, W, C) with H and W divisible by "
                     f"patch_size={patch_size}")
  num_patches = (input_shape[0] // patch_size) * (input_shape[1] // patch_size)
  blocks = [PatchEmbed(patch_size, dim, num_patches, class_token=pool == "cls",
                       dropout=dropout)]
  blocks += [TransformerLayer(dim, num_heads, mlp_ratio, dropout, causal=False)
             for _ in range(depth)]
  blocks.append(ClassifierHead(num_classes, pool))
  labels = ["embed"] + [f"layer{i}" for i in range(depth)] + ["head"]
  return Model(name=name, blocks=tuple(blocks), block_names=tuple(labels),
               input_shape=input_shape, num_classes=num_classes)


def gpt(num_classes: int = 256, *, seq_len: int = 256, dim: int = 256, depth: int = 6,
        num_heads: int = 8, mlp_ratio: float = 4.0, dropout: float = 0.0,
        tie_embeddings: bool = False, name: str = "gpt") -> Model:
  """Decoder-only transformer LM: blocks [embed, layer0..layer{depth-1}, head].

  Args:
    num_classes: the vocabulary size (`models.create`'s num_classes maps to it; 256 = bytes).
    seq_len: the longest sequence (the position table's length); inputs may be shorter.
    dim, depth, num_heads, mlp_ratio: sizes (dim % num_heads == 0).
    dropout: rate after the embedding, on the attention weights and on both residual branches.
    tie_embeddings: must be False (see the module docstring: the embedding and the head are
      always in different stages once the model is split).
  """
  if tie_embeddings:
    raise ValueError(
        "tie_embeddings=True is not supported: the embedding is the first block and the head "
        "the last, so any split into K >= 2 stages puts them in different stages with their "
        "own parameters and delays; use tie_embeddings=False (an untied head, "
        "vocab * dim more parameters)")
  _check_dims(dim, num_heads, depth, mlp_ratio, dropout)
  if num_classes < 1 or seq_len < 1:
    raise ValueError(f"vocabulary size (num_classes) and seq_len must be positive, got "
                     f"{num_classes} and {seq_len}")
  blocks = [TokenEmbed(num_classes, dim, seq_len, dropout)]
  blocks += [TransformerLayer(dim, num_heads, mlp_ratio, dropout, causal=True)
             for _ in range(depth)]
  blocks.append(LMHead(num_classes))
  labels = ["embed"] + [f"layer{i}" for i in range(depth)] + ["head"]
  return Model(name=name, blocks=tuple(blocks), block_names=tuple(labels),
               input_shape=(int(seq_len),), num_classes=num_classes, input_dtype="int32")


def lm_loss(logits, targets, mask=None):
  """Mean next-token cross-entropy of logits [B, T, V] against int targets [B, T].

  `mask` (optional, [B] per sequence or [B, T] per token; 1 = counts) excludes padding.
  """
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets.astype(jnp.int32))
  if mask is None:
    return jnp.mean(losses)
  mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (losses.ndim - mask.ndim)),
                          losses.shape).astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)
