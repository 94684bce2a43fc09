"""Validation of a :class:`jaxmx.KVCache`'s arguments: shapes and static sizes at trace time,
concrete positions and page tables eagerly, traced ones with ``checked=True`` under
:func:`jax.experimental.checkify.checkify`.

A traced index, length or page-table entry cannot be checked while the program is traced; with
``checked=True`` it is checked when the program runs, through ``checkify.check``: the caller
wraps the (jitted) function in ``checkify.checkify`` and calls ``err.throw()``.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> from jax.experimental import checkify
    >>> cache = jaxmx.KVCache.create(1, 8, 1, 32)
    >>> x = jnp.ones((1, 1, 1, 32))
    >>> step = jax.jit(lambda c, i: c.update(x, x, i, checked=True))
    >>> err, _ = checkify.checkify(step)(cache, jnp.int32(8))
    >>> err.get()                                   # doctest: +ELLIPSIS
    'KVCache.update: index 8 of sequence 0 out of range [0, 7] (max_len - new_len = 7) ...'
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxmx._src.core.formats import FORMATS, Format
from jaxmx._src.core.support import lacks, supporting


def describe(cache) -> str:
    """``"the paged mxfp8_e4m3 cache [batch 2, max_len 16, 8 pages of 4]"``, for messages."""
    if cache.page_size is None:
        return f"the contiguous {cache.fmt} cache [batch {cache.batch}, max_len {cache.max_len}]"
    return (
        f"the paged {cache.fmt} cache [batch {cache.batch}, max_len {cache.max_len}, "
        f"{cache.k_codes.shape[0]} pages of {cache.page_size}]"
    )


def checked_format(fmt) -> Format:
    """The :class:`Format` a cache holds, by name: a block-scaled one (a ValueError naming the
    formats the cache takes otherwise)."""
    blocked = supporting("kv_cache")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(
            f"KVCache.create: unknown fmt {fmt!r}; the cache holds one of jaxmx's block-scaled "
            f"formats: {blocked}"
        )
    f = FORMATS[fmt]
    if not f.gemm_operand:
        raise ValueError(
            f"KVCache.create: fmt {fmt!r} is {lacks(f, 'kv_cache')} (no GEMM takes it, and "
            f"attention reads the cache through one); the cache takes one of {blocked}"
        )
    if missing := lacks(f, "kv_cache"):
        raise ValueError(
            f"KVCache.create: fmt {fmt!r} has {missing}, which tokens written a step at a "
            f"time cannot share; the cache takes a block-scaled format: {blocked}"
        )
    return f


def check_positive_int(n, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"KVCache.create: {name} must be a positive int, got {n!r}")


def checked_query(q: jax.Array, cache) -> tuple[int, int, int, int]:
    if q.ndim != 4 or q.shape[0] != cache.batch or q.shape[3] != cache.head_dim:
        raise ValueError(
            f"cached_attention: q must be [batch={cache.batch}, q_len, heads, "
            f"head_dim={cache.head_dim}] for {describe(cache)}, got {q.shape}"
        )
    b, t, heads, d = q.shape
    if heads % cache.kv_heads:
        raise ValueError(
            f"cached_attention: q's {heads} heads must be a multiple of the cache's "
            f"{cache.kv_heads} kv_heads (grouped-query attention)"
        )
    if t > cache.max_len:
        raise ValueError(
            f"cached_attention: q_len {t} exceeds the max_len {cache.max_len} of {describe(cache)}"
        )
    return b, t, heads, d


def checked_new_len(cache, new_len: int) -> None:
    """A write of more tokens than ``max_len`` (static shapes: also under jit) raises."""
    if new_len > cache.max_len:
        raise ValueError(
            f"KVCache.update: {new_len} new tokens do not fit in the max_len {cache.max_len} "
            f"of {describe(cache)}"
        )


def checked_positions(
    x, cache, highest: int, where: str, name: str, bound: str, *, checked: bool
) -> jax.Array:
    """``x`` (int, int scalar or [batch] vector) as an int32 [batch] vector. A concrete value
    outside ``[0, highest]`` raises; a traced one with ``checked`` is a ``checkify.check``."""
    batch = cache.batch
    if isinstance(x, bool) or not (isinstance(x, (int, np.integer)) or hasattr(x, "dtype")):
        raise TypeError(f"{where}: {name} must be an int or an integer array, got {x!r}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{where}: {name} must be an integer, got dtype {x.dtype}")
    if x.shape not in ((), (batch,)):
        raise ValueError(
            f"{where}: {name} must be a scalar or a [batch={batch}] vector, got shape {x.shape}"
        )
    x = jnp.broadcast_to(x.astype(jnp.int32), (batch,))
    tail = f"[0, {highest}] ({bound}) of {describe(cache)}"
    if not isinstance(x, jax.core.Tracer):
        concrete = np.asarray(x)
        bad = np.flatnonzero((concrete < 0) | (concrete > highest))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"{where}: {name} {concrete[b]} of sequence {b} out of range {tail}")
    elif checked:
        bad = (x < 0) | (x > highest)
        b = jnp.argmax(bad)
        checkify.check(
            ~jnp.any(bad),
            f"{where}: {name} {{value}} of sequence {{b}} out of range {tail}",
            value=x[b],
            b=b,
        )
    return x


def check_page_table(cache, where: str, *, checked: bool) -> None:
    """A paged cache's table: ``[batch, ceil(max_len / page_size)]`` integers (static) whose
    entries are pages of the pool: concrete ones eagerly, traced ones with ``checked``."""
    table = cache.page_table
    if cache.page_size is None:
        if table is not None:
            raise ValueError(f"{where}: {describe(cache)} has a page_table; set page_size")
        return
    pages_per_seq = -(-cache.max_len // cache.page_size)
    if table is None or table.shape != (cache.batch, pages_per_seq):
        got = None if table is None else table.shape
        raise ValueError(
            f"{where}: the page_table of {describe(cache)} must be [batch={cache.batch}, "
            f"pages_per_seq={pages_per_seq}], got {got}"
        )
    if not jnp.issubdtype(table.dtype, jnp.integer):
        raise TypeError(f"{where}: the page_table must be integers, got dtype {table.dtype}")
    num_pages = cache.k_codes.shape[0]
    tail = f"is not a page of the pool [0, {num_pages}) of {describe(cache)}"
    if not isinstance(table, jax.core.Tracer):
        concrete = np.asarray(table)
        bad = np.argwhere((concrete < 0) | (concrete >= num_pages))
        if bad.size:
            b, p = (int(i) for i in bad[0])
            raise ValueError(
                f"{where}: page_table[{b}, {p}] = {concrete[b, p]} (sequence {b}, logical page "
                f"{p}) {tail}"
            )
    elif checked:
        bad = (table < 0) | (table >= num_pages)
        flat = jnp.argmax(bad.reshape(-1))
        b, p = flat // pages_per_seq, flat % pages_per_seq
        checkify.check(
            ~jnp.any(bad),
            f"{where}: page_table[{{b}}, {{p}}] = {{value}} (sequence {{b}}, logical page {{p}}) "
            f"{tail}",
            value=table[b, p],
            b=b,
            p=p,
        )


def pages_in_pool(table: jax.Array, num_pages: int) -> jax.Array:
    """Where a (traced) page-table entry names a page of the pool."""
    return (table >= 0) & (table < num_pages)
