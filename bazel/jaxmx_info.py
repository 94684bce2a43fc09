"""Prints where jaxmx and its extension were imported from and how the extension was built.

The main of //bazel:jaxmx_info. It fails unless both come from this binary's runfiles, i.e. are
the Bazel-built package: an editable pip install of jaxmx would win otherwise (its import hook
comes before sys.path).
"""

import os
import sys

import jaxmx
from jaxmx import _ffi


def main() -> None:
    # The runfiles' jaxmx/ is a real directory (of symlinks), next to this file's bazel/.
    package = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../jaxmx"))
    print("jaxmx:", jaxmx.__file__)
    print("jaxmx._ffi:", _ffi.__file__, "->", os.path.realpath(_ffi.__file__))
    print("platforms:", sorted(_ffi.registrations()))
    print("build_info:", _ffi.build_info())
    for module in (jaxmx, _ffi):
        if os.path.realpath(os.path.dirname(module.__file__)) != package:
            sys.exit(
                f"{module.__file__} is not the Bazel-built one in {package}: an editable install?"
            )


if __name__ == "__main__":
    main()
