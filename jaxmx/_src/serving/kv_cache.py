"""``jaxmx.KVCache`` and ``jaxmx.cached_attention``: a KV cache held as MX codes and block scales.

K and V are quantized on write along ``head_dim`` (one scale per block of the format: 32
elements with an E8M0 scale for the MX formats) and written at the decode index. The cache is
contiguous (``[batch, kv_heads, max_len, head_dim]`` codes) or paged (a pool of
``[num_pages, kv_heads, page_size, head_dim]`` codes and a ``[batch, pages_per_seq]`` page
table mapping each sequence's logical pages to physical ones). Attention runs ``Q K^T`` as an MX
GEMM (:func:`jaxmx.matmul`: the dispatcher's kernel, native where it exists; ``q`` is quantized
along ``head_dim``, the reduction axis, as K already is), the masks and the softmax in float32,
then ``P V`` with V decoded to float32 (V's blocks run along ``head_dim``, not along the sequence
that ``P V`` reduces) in a float32 dot. Masked keys contribute nothing; visible NaN / inf
propagate.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> cache = jaxmx.KVCache.create(1, 64, 2, 32)
    >>> k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 32))
    >>> cache = cache.update(k, v, 0)
    >>> q = jax.random.normal(jax.random.key(1), (1, 1, 4, 32))
    >>> jaxmx.cached_attention(q, cache, length=8).shape
    (1, 1, 4, 32)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.formats import Format, get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.packing import held_dtype, held_shape
from jaxmx._src.gemm.matmul import matmul
from jaxmx._src.quantize.quantize import dequantize, quantize
from jaxmx._src.serving import kv_checks
from jaxmx._src.serving.kv_checks import checked_format
from jaxmx._src.serving.masked_attention import masked_pv, masked_softmax, visible_keys

NVFP4_TENSOR_SCALE = 1.0
"""The fixed tensor scale of an NVFP4 cache: tokens are written one step at a time, so the
per-tensor scale cannot follow the data; values are ``code * e4m3_scale`` (block magnitudes
from about ``2^-9 * 6`` to ``448 * 6``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
    """An MX-quantized KV cache (a pytree: jit and scan carry it; ``update`` returns a new one).

    Build one with :meth:`create`. Attributes:
        k_codes, v_codes: element codes as an MXArray holds them (:attr:`MXArray.held`: 4-bit
            codes two per byte, FP6 four per three bytes along ``head_dim``). Contiguous:
            ``[batch, kv_heads, max_len, held]``; paged: the pool ``[num_pages, kv_heads,
            page_size, held]``, ``held`` being ``head_dim`` (``head_dim / 2`` for 4-bit
            codes, ``3 * head_dim / 4`` for FP6).
        k_scales, v_scales: the block scales, the codes' shape with ``head_dim`` divided by the
            format's block (E8M0 bytes for the MX formats).
        page_table: paged only: ``[batch, pages_per_seq]`` int32, the physical page of each
            logical page of each sequence; ``None`` for a contiguous cache.
        fmt: the format name (static); batch, max_len: the logical sizes (static);
            page_size: tokens per page, or ``None`` (static).

    Example:
        >>> import jaxmx
        >>> c = jaxmx.KVCache.create(2, 256, 4, 64, page_size=128)
        >>> c.k_codes.shape, c.page_table.tolist()
        ((4, 4, 128, 64), [[0, 1], [2, 3]])
    """

    k_codes: jax.Array
    k_scales: jax.Array
    v_codes: jax.Array
    v_scales: jax.Array
    page_table: jax.Array | None
    fmt: str
    batch: int
    max_len: int
    page_size: int | None

    @classmethod
    def create(
        cls,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        fmt: str = "mxfp8_e4m3",
        page_size: int | None = None,
    ) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens.

        Args:
            batch, max_len, kv_heads, head_dim: positive ints; ``head_dim`` a multiple of the
                format's block (32 for the MX formats, 16 for NVFP4, 128 for block FP8).
            fmt: any quantization format of jaxmx (:data:`jaxmx.FORMATS`): ``"mxfp8_e4m3"``
                (default), ``"mxfp8_e5m2"``, ``"mxfp4"``, ``"nvfp4"`` (with the fixed tensor
                scale 1), ``"fp8_e4m3_block"``, ``"fp8_e5m2_block"``.
            page_size: ``None`` (contiguous) or the tokens per page of a paged cache (e.g. 128,
                as SGLang); the pool holds ``batch * ceil(max_len / page_size)`` pages and the
                page table maps sequence ``b``'s logical page ``p`` to physical page
                ``b * pages_per_seq + p``.

        Example:
            >>> import jaxmx
            >>> jaxmx.KVCache.create(1, 16, 1, 32).nbytes        # 16 * 32 codes + 16 scales, x2
            1056
        """
        for name, n in (
            ("batch", batch),
            ("max_len", max_len),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            kv_checks.check_positive_int(n, name)
        f = checked_format(fmt)
        if head_dim % f.block:
            raise ValueError(
                f"KVCache.create: head_dim {head_dim} must be a multiple of {f.name}'s block "
                f"({f.block}): the cache quantizes along head_dim"
            )
        if page_size is None:
            rows, page_table = (batch, kv_heads, max_len), None
        else:
            kv_checks.check_positive_int(page_size, "page_size")
            pages_per_seq = -(-max_len // page_size)
            rows = (batch * pages_per_seq, kv_heads, page_size)
            page_table = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, -1)
        codes = jnp.zeros(held_shape((*rows, head_dim), f, axis=-1), held_dtype(f))
        scales = _zero_bytes((*rows, head_dim // f.block), f.scale_dtype)
        return cls(
            k_codes=codes,
            k_scales=scales,
            v_codes=codes,
            v_scales=scales,
            page_table=page_table,
            fmt=f.name,
            batch=batch,
            max_len=max_len,
            page_size=page_size,
        )

    @property
    def format(self) -> Format:
        return get_format(self.fmt)

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_scales.shape[-1] * self.format.block

    @property
    def nbytes(self) -> int:
        """Bytes held: codes (packed: :attr:`k_codes`), scales and the page table.

        Example:
            >>> import jaxmx
            >>> jaxmx.KVCache.create(1, 16, 1, 32, fmt="mxfp4").nbytes   # 16 * 16 + 16, x2
            544
        """
        codes = 2 * self.k_codes.size * self.k_codes.dtype.itemsize
        scales = 2 * self.k_scales.size * self.k_scales.dtype.itemsize
        table = 0 if self.page_table is None else self.page_table.size * 4
        return codes + scales + table

    def update(self, k: jax.Array, v: jax.Array, index, *, checked: bool = False) -> KVCache:
        """The cache with ``k`` and ``v`` (``[batch, new_len, kv_heads, head_dim]``) quantized
        along ``head_dim`` and written at positions ``index .. index + new_len - 1``.

        ``index``: an int, an int32 scalar (traced under jit) or a ``[batch]`` vector (one
        position per sequence). ``new_len > max_len`` raises (at trace time under jit), as do a
        concrete index out of ``[0, max_len - new_len]`` and a concrete page-table entry outside
        the pool. A traced one is not checked unless ``checked=True`` (a
        ``jax.experimental.checkify.check``: run the function under ``checkify.checkify``);
        unchecked, the tokens whose positions fall outside ``[0, max_len)`` or on a page outside
        the pool are not written, in both layouts.

        Example:
            >>> import jax.numpy as jnp, jaxmx
            >>> c = jaxmx.KVCache.create(1, 8, 1, 32)
            >>> c = c.update(jnp.ones((1, 2, 1, 32)), jnp.ones((1, 2, 1, 32)), 3)
            >>> c.k_codes[0, 0, 2:6, 0].astype(float).tolist()    # 1 = 256 * 2^-8 in E4M3
            [0.0, 256.0, 256.0, 0.0]
        """
        k, v = as_float_array(k, "KVCache.update: k"), as_float_array(v, "KVCache.update: v")
        expected = (self.batch, None, self.kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or any(
                e is not None and e != n for e, n in zip(expected, x.shape, strict=False)
            ):
                raise ValueError(
                    f"KVCache.update: {name} must be [batch={self.batch}, new_len, "
                    f"kv_heads={self.kv_heads}, head_dim={self.head_dim}], got {x.shape}"
                )
        if k.shape != v.shape:
            raise ValueError(f"KVCache.update: k {k.shape} and v {v.shape} differ")
        new_len = k.shape[1]
        kv_checks.checked_new_len(self, new_len)
        kv_checks.check_page_table(self, "KVCache.update", checked=checked)
        index = kv_checks.checked_positions(
            index,
            self,
            self.max_len - new_len,
            "KVCache.update",
            "index",
            f"max_len - new_len = {self.max_len - new_len}",
            checked=checked,
        )
        (kc, ks), (vc, vs) = (self._quantized(x) for x in (k, v))
        rows = self._rows(index, new_len)
        return dataclasses.replace(
            self,
            k_codes=self._write(self.k_codes, kc, rows),
            k_scales=self._write(self.k_scales, ks, rows),
            v_codes=self._write(self.v_codes, vc, rows),
            v_scales=self._write(self.v_scales, vs, rows),
        )

    def _quantized(self, x):
        """Codes and scales of ``x`` [batch, new_len, kv_heads, head_dim] along head_dim."""
        q = quantize(x, self.fmt, -1, global_scale=_tensor_scale(self.format))
        return q.held, q.scale

    def _rows(self, index, n: int):
        """Where tokens ``index .. index + n - 1`` go: (leading index, position) ``[batch, n]``
        each; a token outside ``[0, max_len)`` or on a page outside the pool gets an
        out-of-bounds leading index (the write drops it)."""
        pos = index[:, None] + jnp.arange(n, dtype=jnp.int32)  # [batch, n]
        inside = (pos >= 0) & (pos < self.max_len)
        if self.page_size is None:
            lead = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], pos.shape)
            return jnp.where(inside, lead, self.batch), pos
        num_pages = self.k_codes.shape[0]
        page = jnp.clip(pos // self.page_size, 0, self.page_table.shape[1] - 1)
        physical = jnp.take_along_axis(self.page_table.astype(jnp.int32), page, axis=1)
        inside = inside & kv_checks.pages_in_pool(physical, num_pages)
        return jnp.where(inside, physical, num_pages), pos % self.page_size

    @staticmethod
    def _write(x, new, rows):
        """``new`` [batch, n, kv_heads, c] scattered to ``x[lead, :, pos]`` (``rows``)."""
        lead, pos = rows
        return x.at[lead, :, pos, :].set(new, mode="drop")

    def keys(self) -> MXArray:
        """K as an MXArray ``[batch, kv_heads, max_len, head_dim]`` blocked along head_dim (the
        pages gathered in logical order for a paged cache; a page-table entry outside the pool
        reads as NaN)."""
        return self._mx(self.k_codes, self.k_scales)

    def values(self) -> MXArray:
        """V as an MXArray, like :meth:`keys`."""
        return self._mx(self.v_codes, self.v_scales)

    def _mx(self, codes, scales) -> MXArray:
        codes, scales = self._logical(codes), self._logical(scales, outside=_nan_bytes)
        shape = (self.batch, self.kv_heads, self.max_len, self.head_dim)
        g = _tensor_scale(self.format)
        return MXArray.from_held(codes, scales, self.fmt, 3, shape, global_scale=g)

    def _logical(self, x, outside=None):
        """Contiguous ``[batch, kv_heads, max_len, c]`` of a (paged) leaf; the pages a
        page-table entry outside the pool names read as ``outside(shape, dtype)``."""
        if self.page_size is None:
            return x
        ok = kv_checks.pages_in_pool(self.page_table, x.shape[0])
        pages = x[jnp.where(ok, self.page_table, 0)]  # [batch, pages_per_seq, kv_heads, size, c]
        if outside is not None:
            pages = jnp.where(ok[:, :, None, None, None], pages, outside((), x.dtype))
        b, p, h, s, c = pages.shape
        return pages.transpose(0, 2, 1, 3, 4).reshape(b, h, p * s, c)[:, :, : self.max_len]


jax.tree_util.register_dataclass(
    KVCache,
    data_fields=["k_codes", "k_scales", "v_codes", "v_scales", "page_table"],
    meta_fields=["fmt", "batch", "max_len", "page_size"],
)


def cached_attention(
    q: jax.Array,
    cache: KVCache,
    *,
    length,
    is_causal: bool = True,
    scale: float | None = None,
    checked: bool = False,
) -> jax.Array:
    """Attention of ``q`` over the first ``length`` tokens of ``cache``.

    Args:
        q: ``[batch, q_len, heads, head_dim]``, float; ``heads`` a multiple of the cache's
            ``kv_heads`` (grouped-query attention: query head ``n`` reads KV head
            ``n // (heads // kv_heads)``).
        cache: a :class:`KVCache`.
        length: the number of valid cached tokens: an int, an int32 scalar (traced under jit)
            or a ``[batch]`` vector (per-sequence lengths, for padded batches).
        is_causal: query ``i`` sits at absolute position ``length - q_len + i`` and sees keys
            up to it; ``False``: every query sees all ``length`` keys.
        scale: the logits' scale, default ``1 / sqrt(head_dim)``.
        checked: check a traced ``length`` (in ``[0, max_len]``) and page table (pages of the
            pool) when the program runs, with ``jax.experimental.checkify.check`` (run the
            function under ``checkify.checkify``). Concrete ones are always checked; unchecked,
            a traced length past ``max_len`` sees every key, a negative one none, and a page
            outside the pool reads as NaN.

    Returns ``[batch, q_len, heads, head_dim]`` in ``q``'s dtype. ``Q K^T`` is
    :func:`jaxmx.matmul` (float32 out) of ``q`` quantized in the cache's format along
    ``head_dim`` and the cached K; the masks and the softmax are float32; ``P V`` is a float32
    dot of the probabilities and V decoded to float32 (exact for the MX formats and NVFP4; block
    FP8's float32 scale rounds each value once, relative ``2^-24``). A query that sees no key
    (``length`` 0) gets zeros. Masked keys contribute nothing whatever their bits; a visible
    NaN or inf in q, K or V propagates as in float attention
    (:mod:`jaxmx._src.serving.masked_attention`).

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> kv = jax.random.normal(jax.random.key(0), (2, 4, 1, 32))
        >>> cache = jaxmx.KVCache.create(2, 16, 1, 32).update(kv, kv, 0)
        >>> q = jax.random.normal(jax.random.key(1), (2, 4, 2, 32))
        >>> out = jaxmx.cached_attention(q, cache, length=jnp.array([4, 3]))   # prefill
        >>> out.shape, out.dtype
        ((2, 4, 2, 32), dtype('float32'))
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cached_attention: cache must be a jaxmx.KVCache, got {type(cache)}")
    q = as_float_array(q, "cached_attention: q")
    b, t, heads, d = kv_checks.checked_query(q, cache)
    kv_heads = cache.kv_heads
    groups = heads // kv_heads
    kv_checks.check_page_table(cache, "cached_attention", checked=checked)
    length = kv_checks.checked_positions(
        length,
        cache,
        cache.max_len,
        "cached_attention",
        "length",
        f"max_len = {cache.max_len}",
        checked=checked,
    )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    # [b, t, kv_heads * groups, d] -> [b, kv_heads, groups * t, d], quantized along d
    rows = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    g = _tensor_scale(cache.format)  # NVFP4: the cache's fixed 1, as K (a NaN stays in its row)
    qq = quantize(rows.reshape(b, kv_heads, groups * t, d), cache.fmt, -1, global_scale=g)
    logits = matmul(qq, cache.keys(), jnp.float32).reshape(b, kv_heads, groups, t, -1) * scale
    visible = visible_keys(length, t, cache.max_len, is_causal)[:, None, None]  # [b,1,1,t,s]
    p = masked_softmax(logits, visible)
    out = masked_pv(p, visible, dequantize(cache.values(), jnp.float32))
    return out.reshape(b, t, heads, d).astype(q.dtype)


def _nan_bytes(shape, dtype) -> jax.Array:
    """NaN of a scale dtype (E8M0's byte 0xFF, E4M3's 0xFF, float32's NaN)."""
    if jnp.dtype(dtype).itemsize == 1:
        return lax.bitcast_convert_type(jnp.full(shape, 0xFF, jnp.uint8), dtype)
    return jnp.full(shape, jnp.nan, dtype)


def _zero_bytes(shape, dtype) -> jax.Array:
    """All-zero bytes of ``dtype`` (E8M0 has no zero: byte 0 is its smallest scale, 2^-127,
    where ``jnp.zeros`` would give the NaN byte)."""
    width = {1: jnp.uint8, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]
    return lax.bitcast_convert_type(jnp.zeros(shape, width), dtype)


def _tensor_scale(f: Format) -> jax.Array | None:
    return jnp.float32(NVFP4_TENSOR_SCALE) if f.has_global_scale else None
