"""`local_deps`: a repository of what jaxmx._ffi is built from, taken from an installed Python.

Nothing is downloaded: bazel/find_deps.py, run with the interpreter PYTHON_BIN_PATH names
(default python3), says where that Python keeps its headers, nanobind's sources, the XLA FFI
headers (jaxlib's) and, with JAXMX_CUDA=ON, the CUDA headers (JAXMX_CUDA_ROOT, the nvidia-*
wheels or a CUDA toolkit, as for CMake). The directories are symlinked into the repository,
whose BUILD file (bazel/local_deps.BUILD) declares them as cc_library targets; defs.bzl carries
the rest (extension suffix, CUDA on or off, the CUDA defines) to //:BUILD.bazel.
"""

def _string_define(name, value):
    # Bazel splits each define like a shell would: the quotes of the C string are escaped.
    return '%s=\\"%s\\"' % (name, value)

def _local_deps_impl(rctx):
    name = rctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    python = rctx.path(name) if "/" in name else rctx.which(name)
    if not python or not python.exists:
        fail("jaxmx: no Python interpreter '%s' (set PYTHON_BIN_PATH)" % name)
    result = rctx.execute([python, rctx.path(Label("//bazel:find_deps.py"))])
    if result.return_code != 0:
        fail("jaxmx: %s bazel/find_deps.py failed:\n%s" % (python, result.stderr))
    info = json.decode(result.stdout)

    rctx.symlink(info["python_include"], "python")
    rctx.symlink(info["nanobind_include"], "nanobind/include")
    rctx.symlink(info["nanobind_src"], "nanobind/src")
    rctx.symlink(info["robin_map_include"], "nanobind/robin_map")
    rctx.symlink(info["xla_include"], "xla_ffi")
    cuda = info["cuda"]
    cuda_includes, cuda_defines = [], []
    if cuda:
        for i, directory in enumerate(cuda["include_dirs"]):
            cuda_includes.append("cuda/%d" % i)
            rctx.symlink(directory, cuda_includes[-1])

        # String macros for ffi/module.cc (build_info(): the tests compile the cuBLASLt core
        # against the same headers) and ffi/cuda_gemm.cc, as CMake sets them.
        cuda_defines = [
            "JAXMX_WITH_CUDA=1",
            _string_define("JAXMX_CUDA_INCLUDE_DIR", cuda["include_dirs"][0]),
            _string_define("JAXMX_CUDA_INCLUDE_DIRS", ":".join(cuda["include_dirs"])),
            _string_define("JAXMX_CUDA_LIBRARY_HINT", cuda["library_hint"]),
        ]

    rctx.file("defs.bzl", "\n".join([
        "EXT_SUFFIX = %s" % repr(info["ext_suffix"]),
        "WITH_CUDA = %s" % bool(cuda),
        "CUDA_INCLUDES = %s" % repr(cuda_includes),
        "CUDA_DEFINES = %s" % repr(cuda_defines),
        "",
    ]))
    rctx.template("BUILD.bazel", Label("//bazel:local_deps.BUILD"))

local_deps = repository_rule(
    implementation = _local_deps_impl,
    environ = ["PYTHON_BIN_PATH", "JAXMX_CUDA", "JAXMX_CUDA_ROOT"],
    # Looked up again at each Bazel server start, e.g. after pip installed another jaxlib.
    local = True,
)
