"""A small decoder-only transformer in flax.nnx (pre-RMSNorm, learned positions, GELU MLP).

All linear layers are ``nnx.Linear``; :func:`jaxmx.flax.nnx.quantize_model` routes them through
jaxmx. The token embedding and the output head (named ``embed`` / ``head``) stay in high precision.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxmx.demo.model import Transformer
    >>> m = Transformer(vocab=256, d_model=32, layers=1, heads=2, seq_len=16, rngs=nnx.Rngs(0))
    >>> m(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), 3, axis=2)
        y = self.attention_fn(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
        return self.out(y.reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, d_model: int, *, dtype, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = _zero_linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, d_model: int, heads: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(d_model, heads, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nnx.Module):
    """Decoder-only byte-level language model; returns float32 logits [batch, seq, vocab].

    ``dtype`` is the compute dtype (bfloat16 by default); parameters are float32 master weights.
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
    ):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, embedding_init=init, rngs=rngs)
        self.pos_embed = nnx.Param(init(rngs.params(), (seq_len, d_model), jnp.float32))
        self.blocks = nnx.List(
            [Block(d_model, heads, dtype=dtype, rngs=rngs) for _ in range(layers)]
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
