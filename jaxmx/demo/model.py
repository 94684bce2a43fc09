"""A small decoder-only transformer in flax.nnx (pre-RMSNorm, learned positions, GELU MLP).

With ``save_fmt`` (one of ``jaxmx.SAVE_FORMATS``) each block keeps the inputs of its norms, of the
attention output's Linear and of the GELU quantized for the backward pass
(``jaxmx.save_quantized``): ``norm1 -> qkv -> attention``, ``out``, ``norm2 -> up`` and
``GELU -> down`` each save their input in that format and are recomputed from it in the backward
pass (so the attention scores are not kept either).

All linear layers are ``nnx.Linear``; :func:`jaxmx.flax.nnx.quantize_model` routes them through
jaxmx. The token embedding and the output head (named ``embed`` / ``head``) stay in high precision.

:meth:`Transformer.decode` runs the same model on a chunk of tokens at a (traced) position with a
KV cache per block (:func:`init_caches`): a :class:`DenseCache` in the model's dtype, or a
``jaxmx.KVCache`` (MX codes and scales, attended by ``jaxmx.cached_attention``).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxmx.demo.model import Transformer
    >>> m = Transformer(vocab=256, d_model=32, layers=1, heads=2, seq_len=16, rngs=nnx.Rngs(0))
    >>> m(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxmx


def _zero_linear(d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free ``nnx.Linear`` with a zero kernel: the residual branch it ends starts as 0."""
    zeros = nnx.initializers.zeros_init()
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, kernel_init=zeros, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, d_model: int, heads: int, *, dtype, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = _zero_linear(d_model, d_model, dtype=dtype, rngs=rngs)
        self.attention_fn = nnx.dot_product_attention  # jaxmx.flax.MXAttention for MX QK^T, PV

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values ``[batch, t, heads, head_dim]`` of ``x [batch, t, d]``."""
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), 3, axis=2)
        return q[:, :, 0], k[:, :, 0], v[:, :, 0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.mix(x))

    def mix(self, x: jax.Array) -> jax.Array:
        """The attention's output before its ``out`` Linear, ``[batch, t, d]``."""
        y = self.attention_fn(*self._qkv(x), is_causal=True)
        return y.reshape(x.shape)

    def decode(self, x: jax.Array, cache, index) -> tuple[jax.Array, object]:
        """``x [batch, t, d]`` at positions ``index .. index + t - 1``: writes its keys and
        values into ``cache`` (a :class:`DenseCache` or a ``jaxmx.KVCache``) and attends
        causally over the cached positions ``< index + t``; returns ``(y, cache)``."""
        q, k, v = self._qkv(x)
        cache = cache.update(k, v, index)
        y = cached_attention(q, cache, length=index + x.shape[1])
        return self.out(y.reshape(x.shape)), cache


class MLP(nnx.Module):
    def __init__(self, d_model: int, *, dtype, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = _zero_linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


def saved_quantized(fmt: str | None, fn, modules, x: jax.Array) -> jax.Array:
    """``fn(modules, x)``, with ``x`` kept in ``fmt`` for the backward pass
    (``jaxmx.save_quantized``; the modules' parameters passed as arguments); ``None``: as is."""
    if fmt is None:
        return fn(modules, x)
    graphdef, state = nnx.split(modules)

    def pure(x, state):
        return fn(nnx.merge(graphdef, state), x)

    return jaxmx.save_quantized(pure, fmt)(x, state)


class Block(nnx.Module):
    def __init__(
        self, d_model: int, heads: int, *, dtype, rngs: nnx.Rngs, save_fmt: str | None = None
    ):
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(d_model, heads, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d_model, dtype=dtype, rngs=rngs)
        self.save_fmt = save_fmt

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.save_fmt is None:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        fmt = self.save_fmt
        y = saved_quantized(fmt, lambda m, x: m[1].mix(m[0](x)), (self.norm1, self.attn), x)
        x = x + saved_quantized(fmt, lambda m, y: m(y), self.attn.out, y)
        h = saved_quantized(fmt, lambda m, x: m[1](m[0](x)), (self.norm2, self.mlp.up), x)
        return x + saved_quantized(fmt, lambda m, h: m.down(jax.nn.gelu(h)), self.mlp, h)

    def decode(self, x: jax.Array, cache, index) -> tuple[jax.Array, object]:
        """:meth:`__call__` at positions ``index ..`` with the block's KV cache."""
        y, cache = self.attn.decode(self.norm1(x), cache, index)
        x = x + y
        return x + self.mlp(self.norm2(x)), cache


class Transformer(nnx.Module):
    """Decoder-only byte-level language model; returns float32 logits [batch, seq, vocab].

    ``dtype`` is the compute dtype (bfloat16 by default); parameters are float32 master weights.
    ``save_fmt``: the format each block keeps its saved activations in (see the module), or
    ``None`` (default): as autodiff keeps them.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        layers: int,
        heads: int,
        seq_len: int,
        *,
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
        save_fmt: str | None = None,
    ):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, embedding_init=init, rngs=rngs)
        self.pos_embed = nnx.Param(init(rngs.params(), (seq_len, d_model), jnp.float32))
        self.blocks = nnx.List(
            [
                Block(d_model, heads, dtype=dtype, rngs=rngs, save_fmt=save_fmt)
                for _ in range(layers)
            ]
        )
        self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos_embed[...][:t].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)

    def decode(self, tokens: jax.Array, caches: list, index) -> tuple[jax.Array, list]:
        """Logits ``[batch, t, vocab]`` (float32) of ``tokens [batch, t]`` at positions
        ``index .. index + t - 1``, given ``caches`` (one per block, :func:`init_caches`) that
        hold the positions before ``index``; returns ``(logits, caches)`` with the new keys and
        values written. ``index`` is an int or an int32 scalar (traced under jit: one program
        for every step). A prefill is ``decode(prompt, caches, 0)``; a full sequence at
        ``index`` 0 gives the logits of ``model(tokens)``.

        Example:
            >>> from flax import nnx
            >>> m = Transformer(vocab=256, d_model=32, layers=1, heads=1, seq_len=16,
            ...                 rngs=nnx.Rngs(0))
            >>> caches = init_caches(m, batch=2, max_len=16, fmt="mxfp8_e4m3")
            >>> logits, caches = m.decode(jnp.zeros((2, 5), jnp.int32), caches, 0)
            >>> logits.shape, caches[0].fmt
            ((2, 5, 256), 'mxfp8_e4m3')
        """
        if len(caches) != len(self.blocks):
            raise ValueError(f"{len(caches)} caches for {len(self.blocks)} blocks")
        t = tokens.shape[1]
        if isinstance(index, int) and not 0 <= index <= self.pos_embed.shape[0] - t:
            raise ValueError(
                f"positions {index} .. {index + t - 1} are past the model's "
                f"{self.pos_embed.shape[0]} learned positions"
            )
        positions = lax.dynamic_slice_in_dim(self.pos_embed[...], index, t)
        x = self.embed(tokens) + positions.astype(self.dtype)
        new_caches = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.decode(x, cache, index)
            new_caches.append(cache)
        return self.head(self.norm(x)).astype(jnp.float32), new_caches


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseCache:
    """A plain KV cache: ``k``, ``v`` ``[batch, max_len, heads, head_dim]`` in one dtype (the
    model's; bfloat16 by default), the baseline of ``jaxmx.KVCache``. ``update`` and
    ``nbytes`` are those of ``jaxmx.KVCache``: a concrete ``index`` out of range raises, a
    traced one is clamped into range (``lax.dynamic_update_slice``).

    Example:
        >>> c = DenseCache.create(1, 16, 2, 32)
        >>> c.k.dtype, c.nbytes                      # 2 x 16 x 2 x 32 x 2 bytes
        (dtype(bfloat16), 4096)
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype=jnp.bfloat16):
        zeros = jnp.zeros((batch, max_len, heads, head_dim), dtype)
        return cls(k=zeros, v=zeros)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, k: jax.Array, v: jax.Array, index) -> DenseCache:
        """The cache with ``k``, ``v`` ``[batch, t, heads, head_dim]`` written at positions
        ``index .. index + t - 1``."""
        t = k.shape[1]
        if isinstance(index, int) and not 0 <= index <= self.max_len - t:
            raise ValueError(f"DenseCache.update: index {index} outside 0 .. {self.max_len - t}")
        start = (0, index, 0, 0)
        return DenseCache(
            k=lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), start),
            v=lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), start),
        )


def init_caches(
    model: Transformer, batch: int, max_len: int, fmt: str | None = None
) -> list[DenseCache | jaxmx.KVCache]:
    """Empty KV caches for ``model.decode``, one per block: :class:`DenseCache` in the model's
    dtype with ``fmt=None``, else ``jaxmx.KVCache.create(..., fmt=fmt)`` (``head_dim`` a
    multiple of the format's block)."""
    heads = model.blocks[0].attn.heads
    head_dim = model.embed.features // heads
    if fmt is None:
        return [
            DenseCache.create(batch, max_len, heads, head_dim, model.dtype) for _ in model.blocks
        ]
    return [jaxmx.KVCache.create(batch, max_len, heads, head_dim, fmt=fmt) for _ in model.blocks]


def cached_attention(q: jax.Array, cache, *, length) -> jax.Array:
    """Causal attention of ``q [batch, t, heads, head_dim]`` at positions ``length - t ..
    length - 1`` over the cached keys and values: ``jaxmx.cached_attention`` for a
    ``jaxmx.KVCache``; for a :class:`DenseCache`, float32 scores, masks and softmax over its
    values (the result in ``q``'s dtype)."""
    if isinstance(cache, jaxmx.KVCache):
        return jaxmx.cached_attention(q, cache, length=length)
    t, d = q.shape[1], q.shape[-1]
    f32 = jnp.float32
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), cache.k.astype(f32)) / math.sqrt(d)
    visible = jnp.arange(cache.max_len)[None, :] <= (length - t + jnp.arange(t))[:, None]
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, cache.v.astype(f32)).astype(q.dtype)


def generate(
    model: Transformer,
    prompt: bytes,
    length: int,
    *,
    seq_len: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> bytes:
    """Samples ``length`` bytes after ``prompt`` (the context is the last ``seq_len`` bytes).

    Example:
        >>> from flax import nnx
        >>> m = Transformer(vocab=256, d_model=32, layers=1, heads=2, seq_len=16, rngs=nnx.Rngs(0))
        >>> len(generate(m, b"def ", 5, seq_len=16))
        5
    """

    @nnx.jit
    def next_logits(model, window, last):
        return model(window)[0, last]

    tokens = list(prompt) or [ord("\n")]
    key = jax.random.key(seed)
    for _ in range(length):
        context = tokens[-seq_len:]
        window = jnp.zeros((1, seq_len), jnp.int32).at[0, : len(context)].set(jnp.array(context))
        logits = next_logits(model, window, len(context) - 1)
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / temperature)))
    return bytes(tokens[-length:]) if length else b""
