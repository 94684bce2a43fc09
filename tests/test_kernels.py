"""Kernels as values: what the dispatcher returns says what each caller asks of it, and one
executor runs the choice on each lowering platform, whatever the platform is called."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from machines import BLACKWELL, HOPPER

import jaxmx
from jaxmx._src.gemm.capabilities import REQUIREMENTS
from jaxmx._src.gemm.dispatch import KERNELS, NATIVE, Gemm, kernels
from jaxmx._src.gemm.kernels import ROLES, Kernel, execute

TRAINING = pathlib.Path(jaxmx.__file__).parent / "_src" / "training"
A, B = jnp.ones((2, 3)), jnp.ones((4, 3))  # a @ b.T is 3 everywhere


def _times(factor: float):
    return lambda a, b, out_dtype, _: (factor * (a @ b.T)).astype(out_dtype)


def test_each_native_kernel_needs_its_family_and_runs_on_cuda():
    assert set(NATIVE) == set(REQUIREMENTS)
    for family, kernel in NATIVE.items():
        assert (kernel.needs, kernel.platform, kernel.name) == (family, "cuda", "native")
    for kernel in KERNELS:
        # a kernel that needs a device names the platform it runs on; only plain JAX gathers
        assert (kernel.needs is None) == (kernel.platform is None), kernel
        assert not (kernel.gathers_8bit and kernel.needs), kernel
    assert [k.name for k in KERNELS if k.takes_values] == ["emulate_values"]
    assert len(set(KERNELS)) == len(KERNELS)


@pytest.mark.parametrize("machine", [BLACKWELL, HOPPER], ids=["blackwell", "hopper"])
def test_the_dispatcher_puts_a_native_kernel_under_its_platform_where_its_needs_are_met(machine):
    pairs = [("mxfp8_e4m3",) * 2, ("nvfp4",) * 2, ("fp8_e4m3_block",) * 2, ("fp8_e4m3_tensor",) * 2]
    for formats in pairs:
        chosen = kernels(Gemm(formats=formats, scale_mode="fp32"), machine)
        for platform, kernel in chosen.items():
            if platform != "default":
                assert platform == kernel.platform and machine.supports(kernel.needs)
        family = jaxmx.FORMATS[formats[0]].gemm
        assert (NATIVE[family] in chosen.values()) == machine.supports(family), formats


def test_execute_runs_each_kernel_on_its_own_platform_of_any_name():
    def negated(a, b, out_dtype, _):
        return -(a @ b.T).astype(out_dtype)

    plus = Kernel(name="plus", run=_times(1.0))
    chosen = {"default": plus, "rocm": Kernel(name="minus", run=negated, platform="rocm")}
    np.testing.assert_array_equal(execute(chosen, A, B, jnp.float32), np.full((2, 4), 3.0))

    def lowered(platform: str) -> str:
        f = jax.jit(lambda a, b: execute(chosen, a, b, jnp.float32))
        return f.trace(A, B).lower(lowering_platforms=(platform,)).as_text()

    assert "stablehlo.negate" in lowered("rocm")
    assert "stablehlo.negate" not in lowered("cpu")


def test_each_role_runs_its_runner_and_an_unknown_role_is_refused():
    full = Kernel(name="k", run=_times(1.0), training=_times(2.0), forward=_times(3.0))
    fallback = Kernel(name="k", run=_times(1.0), training=_times(2.0))  # forward: training's
    for kernel, wants in ((full, (3.0, 6.0, 9.0)), (fallback, (3.0, 6.0, 6.0))):
        for role, want in zip(ROLES, wants, strict=True):
            got = execute({"default": kernel}, A, B, jnp.float32, role=role)
            np.testing.assert_array_equal(got, np.full((2, 4), want))
    with pytest.raises(ValueError, match="kernel role must be one of"):
        execute({"default": full}, A, B, jnp.float32, role="backward")


def test_execute_prepares_each_operand_for_the_kernel_that_takes_it():
    chosen = {"default": Kernel(name="values", run=_times(1.0), takes_values=True)}

    def prepare(kernel, x):
        return x * 2 if kernel.takes_values else x

    got = execute(chosen, A, B, jnp.float32, prepare=prepare)
    np.testing.assert_array_equal(got, np.full((2, 4), 12.0))


def _kernel_names_in(path: pathlib.Path) -> list[str]:
    """String constants of ``path`` that name a kernel, docstrings and ``backend=`` values (the
    public backend names ``"emulate"`` and ``"xla"``) aside."""
    names = {k.name for k in KERNELS}
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg == "backend":
            skip.add(id(node.value))
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip
    ]


def test_training_code_holds_no_kernel_names():
    """Training GEMMs read a kernel's properties (``takes_values``, ``gathers_8bit``, its
    runners), never its name."""
    assert [hit for path in sorted(TRAINING.glob("*.py")) for hit in _kernel_names_in(path)] == []


def test_a_native_gemm_lowers_to_its_custom_call_without_a_platform_switch_of_its_own():
    """The executor's ``platform_dependent`` is the only one on a GEMM's path: the custom call
    is lowered per platform by its own lowering rules (no ``case`` over platforms inside)."""
    a = jaxmx.quantize(jnp.ones((16, 64)), "mxfp8_e4m3")
    f = jax.jit(lambda a, b: jaxmx.ffi.mx_matmul(a, b))
    text = f.trace(a, a).lower(lowering_platforms=("cpu",)).as_text()
    assert "jaxmx_mx_matmul" in text
    assert text.count("stablehlo.case") == 0
