"""Kernels as values, and the one executor that runs the dispatcher's choice.

A :class:`Kernel` is one way to run a GEMM of two quantized operands: its name (for messages and
reports), the native GEMM it needs of the device (``needs``, a key of
:data:`~jaxmx._src.gemm.capabilities.REQUIREMENTS`) and the lowering platform it is chosen for
there (``platform``), its runners per :data:`ROLES`, whether it takes operands quantized straight
to element values (``takes_values``), and its SPMD form (``gathers_8bit``). Each implementation
module defines its own kernels (:mod:`~jaxmx._src.gemm.emulate`,
:mod:`~jaxmx._src.gemm.native.mx`, ...); the dispatcher (:mod:`~jaxmx._src.gemm.dispatch`)
chooses one per lowering platform and :func:`execute` runs that choice, for :func:`jaxmx.matmul`
and for every training GEMM.

Example:
    >>> import jax.numpy as jnp
    >>> k = Kernel(name="product", run=lambda a, b, out_dtype, _: (a @ b.T).astype(out_dtype))
    >>> k
    <Kernel product>
    >>> execute({"default": k}, jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.float32).tolist()
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
from jax import lax

Runner = Callable
"""``(a, b, out_dtype, accumulation) -> out``: a kernel's GEMM on its operands."""

ROLES = ("exact", "training", "forward")
"""What a GEMM runs a kernel for: ``"exact"`` (:func:`jaxmx.matmul`: exact for every scale
span), ``"training"`` (a training GEMM's dgrad and wgrad GEMMs), ``"forward"`` (a training
GEMM's forward GEMM)."""


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Kernel:
    """One kernel the dispatcher may choose (hashable: the runners are module-level functions).

    Example:
        >>> k = Kernel(name="product", run=lambda a, b, out_dtype, _: a @ b.T)
        >>> k.runner("forward") is k.run, k.needs, k.takes_values
        (True, None, False)
    """

    # the kernel's name, as messages, docs and reports say it
    name: str
    # the runner of jaxmx.matmul, exact for every scale span
    run: Runner
    # the training GEMMs' runner (None: `run`)
    training: Runner | None = None
    # a training GEMM's forward runner (None: `training`)
    forward: Runner | None = None
    # the native GEMM the device must run (a capabilities.REQUIREMENTS key; None: any device)
    needs: str | None = None
    # the lowering platform `backend="auto"` chooses it for where the device runs `needs`
    # (None: every platform, the dispatcher's "default")
    platform: str | None = None
    # it takes operands quantized straight to element values (GridArrays) from a caller that
    # quantizes, MXArrays otherwise
    takes_values: bool = False
    # plain JAX that, under SPMD outside shard_map, runs partitioned with its operands gathered
    # as 8-bit codes and scales (jaxmx._src.gemm.gathered)
    gathers_8bit: bool = False

    def runner(self, role: str) -> Runner:
        """The runner for ``role`` (one of :data:`ROLES`)."""
        if role not in ROLES:
            raise ValueError(f"kernel role must be one of {ROLES}, got {role!r}")
        if role == "forward" and self.forward is not None:
            return self.forward
        if role != "exact" and self.training is not None:
            return self.training
        return self.run

    def __repr__(self) -> str:
        return f"<Kernel {self.name}>"


def execute(
    chosen: Mapping[str, Kernel],
    a,
    b,
    out_dtype,
    *,
    role: str = "exact",
    accumulation=None,
    prepare: Callable | None = None,
) -> jax.Array:
    """Runs the kernels of :func:`~jaxmx._src.gemm.dispatch.kernels` (``{platform: Kernel}``,
    with a ``"default"``), each on its lowering platform: one ``lax.platform_dependent`` where
    they differ, the one kernel as it is otherwise.

    ``prepare``: ``(kernel, operand) -> operand``, each operand as that kernel takes it (a
    caller that quantizes where used: element values for a kernel that ``takes_values``);
    ``None``: the operands as they are (checked MXArrays)."""

    def branch(kernel: Kernel):
        run = kernel.runner(role)

        def go():
            if prepare is None:
                return run(a, b, out_dtype, accumulation)
            return run(prepare(kernel, a), prepare(kernel, b), out_dtype, accumulation)

        return go

    branches = {platform: branch(kernel) for platform, kernel in chosen.items()}
    if len(branches) == 1:
        return branches["default"]()
    return lax.platform_dependent(**branches)
