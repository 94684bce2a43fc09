"""Orbax checkpoints of pytrees holding MXArrays that keep each MXArray's identity.

An MXArray's format, axis, logical shape and tile are static pytree metadata: orbax saves only
its codes and scales, and restoring into a target of another format casts the codes by value
(E4M3 codes read as E5M2 are off by up to a quarter of their value, silently). :func:`save_orbax`
saves the tree with its :func:`mx_layout` as a second, JSON item; :func:`restore_orbax` reads
that first and refuses, naming the weight and both formats, a target whose MXArrays differ
(:func:`check_mx_layout`), before orbax reads a code.

Example:
    >>> import tempfile, jax.numpy as jnp, jaxmx
    >>> from jaxmx import checkpoints
    >>> w = jaxmx.quantize(jnp.ones((4, 32)), "mxfp8_e4m3")
    >>> checkpoints.mx_layout({"w": w})
    {"['w']": {'fmt': 'mxfp8_e4m3', 'axis': 1, 'shape': [4, 32], 'tile': None}}
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> checkpoints.save_orbax(path, {"w": w})
    >>> other = jaxmx.quantize(jnp.ones((4, 32)), "mxfp8_e5m2")
    >>> checkpoints.restore_orbax(path, {"w": other})
    Traceback (most recent call last):
    ...
    ValueError: restore_orbax: ['w'] was saved as an mxfp8_e4m3 MXArray ... an mxfp8_e5m2 ...
"""

from __future__ import annotations

import json
import os

import jax

from jaxmx._src.core.mxarray import MXArray

_STATE, _LAYOUT = "state", "mx_layout"


def mx_layout(tree) -> dict[str, dict]:
    """``{path: {"fmt", "axis", "shape", "tile"}}`` of every MXArray in ``tree`` (JSON-able;
    ``path`` as ``jax.tree_util.keystr`` writes it): what orbax does not save of them."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, MXArray))
    return {
        jax.tree_util.keystr(path): _identity(leaf)
        for path, leaf in found[0]
        if isinstance(leaf, MXArray)
    }


def _identity(q: MXArray) -> dict:
    tile = None if q.tile is None else list(q.tile)
    return {"fmt": q.fmt, "axis": q.axis, "shape": list(q.shape), "tile": tile}


def _describe(identity: dict) -> str:
    tile = f", tile {tuple(identity['tile'])}" if identity["tile"] else ""
    return (
        f"{identity['fmt']} MXArray (axis {identity['axis']}, shape {tuple(identity['shape'])}"
        f"{tile})"
    )


def check_mx_layout(saved: dict[str, dict], target, where: str = "check_mx_layout") -> None:
    """A ValueError, naming the path and both formats, unless the MXArrays of ``target`` (a
    tree, or abstract tree, to restore into) are those of ``saved`` (a :func:`mx_layout`):
    the same paths, formats, axes, logical shapes and tiles."""
    wanted = mx_layout(target)
    for path in sorted(saved.keys() | wanted.keys()):
        have, want = saved.get(path), wanted.get(path)
        if have == want:
            continue
        if have is None:
            raise ValueError(
                f"{where}: the target holds an {_describe(want)} at {path}, the checkpoint no "
                "MXArray there"
            )
        if want is None:
            raise ValueError(
                f"{where}: {path} was saved as an {_describe(have)}; the target holds no MXArray "
                "there (convert the target model the same way before restoring)"
            )
        raise ValueError(
            f"{where}: {path} was saved as an {_describe(have)}, the target is an "
            f"{_describe(want)}: restoring would reinterpret its codes; build the target in "
            f"{have['fmt']} (or requantize after restoring)"
        )


def save_orbax(path: str | os.PathLike, tree) -> None:
    """Saves ``tree`` with orbax, with its :func:`mx_layout` beside it (the item
    ``mx_layout``, JSON), and waits until it is written. ``path`` must not exist."""
    ocp = _orbax()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            os.path.abspath(path),
            ocp.args.Composite(
                **{
                    _STATE: ocp.args.StandardSave(tree),
                    _LAYOUT: ocp.args.JsonSave(mx_layout(tree)),
                }
            ),
        )


def restore_orbax(path: str | os.PathLike, target):
    """The tree :func:`save_orbax` saved at ``path``, restored into the structure, shapes and
    dtypes of ``target`` (a tree of arrays or ``jax.ShapeDtypeStruct`` leaves; MXArrays keep
    theirs), after :func:`check_mx_layout` of the saved layout against ``target``.

    Raises:
        ValueError: an MXArray of ``target`` differs from the saved one (format, axis, shape or
            tile), or is missing from either; the path and both are named.
    """
    ocp = _orbax()
    path = os.path.abspath(path)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        saved = checkpointer.restore(path, ocp.args.Composite(**{_LAYOUT: ocp.args.JsonRestore()}))
        check_mx_layout(json.loads(json.dumps(saved[_LAYOUT])), target, "restore_orbax")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = checkpointer.restore(
            path, ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
        )
    return restored[_STATE]


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "save_orbax / restore_orbax need orbax-checkpoint: pip install orbax-checkpoint"
        ) from e
    return ocp
