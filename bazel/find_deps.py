"""Prints, as JSON, where this Python keeps what jaxmx._ffi is built from (bazel/local_deps.bzl).

Run by the `local_deps` repository rule with the interpreter PYTHON_BIN_PATH names: Python's
headers and extension suffix, nanobind's sources, the XLA FFI headers (jaxlib's) and, with
JAXMX_CUDA=ON, the CUDA headers, found where CMakeLists.txt looks for them. A missing input
exits with status 1 and a message saying what to install.
"""

import json
import os
import shutil
import site
import sys
import sysconfig

# Below a root, where cublasLt.h and what it includes may lie (CMakeLists.txt's _suffixes):
# CUDA 13 wheels: nvidia/cu13/include (+ cccl/); CUDA 12 wheels: one include dir per wheel.
CUDA_SUFFIXES = (
    "include",
    "nvidia/cu13/include",
    "nvidia/cu13/include/cccl",
    "nvidia/cublas/include",
    "nvidia/cuda_runtime/include",
    "nvidia/cuda_nvcc/include",
    "include/cccl",
    ".",
)


def cuda_roots() -> list[str]:
    """JAXMX_CUDA_ROOT, this Python's site-packages (the nvidia-* wheels), a CUDA toolkit."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("JAXMX_CUDA_ROOT", ""), *site.getsitepackages()]
    roots += [site.getusersitepackages(), os.environ.get("CUDA_PATH", "")]
    roots += [os.path.dirname(os.path.dirname(nvcc)) if nvcc else "", "/usr/local/cuda"]
    return [r for r in roots if r and os.path.isdir(r)]


def find(header: str, roots: list[str]) -> str:
    for root in roots:
        for suffix in CUDA_SUFFIXES:
            directory = os.path.normpath(os.path.join(root, suffix))
            if os.path.exists(os.path.join(directory, header)):
                return directory
    sys.exit(
        f"jaxmx: JAXMX_CUDA=ON but {header} is not below any of {roots}: pip install "
        "nvidia-cublas nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl, or set JAXMX_CUDA_ROOT"
    )


def cuda() -> dict:
    roots = cuda_roots()
    lt = find("cublasLt.h", roots)
    with open(os.path.join(lt, "cublasLt.h")) as f:
        if "CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0" not in f.read():
            sys.exit(f"jaxmx: {lt}/cublasLt.h predates MX block scaling (CUDA >= 12.8 needed)")
    included = ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target")  # what cublasLt.h needs
    others = [find(header, [lt, *roots]) for header in included]
    return {
        "include_dirs": list(dict.fromkeys([lt, *others])),
        # A lib/ dir beside the headers: the handler's last-resort place to dlopen the libraries.
        "library_hint": os.path.normpath(os.path.join(lt, "..", "lib")),
    }


def main() -> None:
    try:
        import jax
        import nanobind
    except ImportError as e:
        sys.exit(f"jaxmx: {sys.executable} cannot import {e.name}: pip install jax nanobind")
    robin_map = os.path.join(os.path.dirname(nanobind.source_dir()), "ext", "robin_map", "include")
    if not os.path.isdir(robin_map):
        sys.exit(f"jaxmx: nanobind at {nanobind.source_dir()} lacks ext/robin_map (pip install it)")
    want_cuda = os.environ.get("JAXMX_CUDA", "").upper() in ("ON", "1", "TRUE")
    info = {
        "python_include": sysconfig.get_paths()["include"],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "nanobind_include": nanobind.include_dir(),
        "nanobind_src": nanobind.source_dir(),
        "robin_map_include": robin_map,
        "xla_include": jax.ffi.include_dir(),
        "cuda": cuda() if want_cuda else None,
    }
    print(json.dumps(info))


if __name__ == "__main__":
    main()
