"""A Llama-architecture decoder in Flax nnx, small enough to read in one sitting.

It computes what Hugging Face's ``LlamaForCausalLM`` computes (default rotary embeddings,
grouped-query attention, SiLU-gated MLP, RMSNorm in float32), and its attribute tree mirrors
Hugging Face's parameter names, so a checkpoint maps onto it by name:

- ``model.layers.0.self_attn.q_proj.weight`` is ``("model", "layers", 0, "self_attn", "q_proj",
  "kernel")``, transposed (``nnx.Linear`` keeps ``[in, out]``, torch ``[out, in]``);
- ``model.norm.weight`` is ``("model", "norm", "scale")``, and the same for the layer norms;
- ``model.embed_tokens.weight`` is ``("model", "embed_tokens", "embedding")``.

Every projection is a plain ``nnx.Linear``, so ``jaxmx.flax.nnx.quantize_model`` and
``quantize_weights`` find and convert them. There is no KV cache: each call runs the whole
sequence.

    >>> from flax import nnx
    >>> config = Config(vocab_size=96, hidden_size=64, intermediate_size=128,
    ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = Llama(config, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 12), jnp.int32)).shape
    (2, 12, 96)
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The fields of a transformers ``LlamaConfig`` that describe the model.

    ``head_dim`` of ``None`` is ``hidden_size // num_attention_heads``. ``max_position_embeddings``
    is recorded, not enforced (as in transformers, rope extends past it).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_hf(cls, config: dict) -> "Config":
        """The config of a transformers ``config.json`` dict, old (``rope_theta`` at the top)
        or new (``rope_parameters``). Refuses what this model does not compute: scaled rotary
        embeddings (``llama3``, ``linear``, ...), biases, an activation other than SiLU."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}: only the default rope is here")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise NotImplementedError("attention_bias / mlp_bias: the projections have no bias")
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config['hidden_act']!r}: only silu is here")
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in config.items() if k in fields}
        given.setdefault("num_key_value_heads", config["num_attention_heads"])
        if "rope_theta" in rope:
            given["rope_theta"] = rope["rope_theta"]
        return cls(**given)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, normalised in float32 and cast back to ``x``'s dtype before the
    scale, as ``LlamaRMSNorm`` does."""

    def __init__(self, features: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotates ``x`` [B, T, heads, head_dim] by its positions 0..T-1 (Hugging Face's
    ``rotate_half`` layout: dimension ``i`` pairs with ``i + head_dim/2``)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq  # [T, dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, dim]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings; each of the ``num_key_value_heads`` key /
    value heads serves ``num_attention_heads / num_key_value_heads`` query heads."""

    def __init__(self, config: Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config = config
        d, h = config.hidden_size, config.head_dim
        linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d, config.num_attention_heads * h, **linear)
        self.k_proj = nnx.Linear(d, config.num_key_value_heads * h, **linear)
        self.v_proj = nnx.Linear(d, config.num_key_value_heads * h, **linear)
        self.o_proj = nnx.Linear(config.num_attention_heads * h, d, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        b, t, _ = x.shape
        kv, group = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
        q = rotary(self.q_proj(x).reshape(b, t, kv * group, c.head_dim), c.rope_theta)
        k = rotary(self.k_proj(x).reshape(b, t, kv, c.head_dim), c.rope_theta)
        v = self.v_proj(x).reshape(b, t, kv, c.head_dim)
        q = q.reshape(b, t, kv, group, c.head_dim)  # query head n = kv head n // group
        scores = jnp.einsum("bqkgh,bskh->bkgqs", q, k) * c.head_dim**-0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bskh->bqkgh", weights, v)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(d, f, **linear)
        self.up_proj = nnx.Linear(d, f, **linear)
        self.down_proj = nnx.Linear(f, d, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        eps, d = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, param_dtype=param_dtype)
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    """Token embeddings, the decoder layers and the final norm (Hugging Face's ``model.``)."""

    def __init__(self, config: Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List(
            DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nnx.Module):
    """``LlamaForCausalLM``: tokens [B, T] int to float32 logits [B, T, vocab_size].

    ``dtype`` is the computation dtype, ``param_dtype`` the parameters'. With
    ``tie_word_embeddings`` there is no ``lm_head``: the logits use the embedding table.
    """

    def __init__(
        self, config: Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.config = config
        self.model = LlamaModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.model(tokens)
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)
