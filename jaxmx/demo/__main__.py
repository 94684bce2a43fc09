"""``python -m jaxmx.demo``: :mod:`jaxmx.demo.cli` reads the command line (argparse only, so that
``--help`` and a bad flag answer before jax, flax, optax and orbax load), then
:func:`jaxmx.demo.commands.main` runs it."""

import sys

from jaxmx.demo import cli

if __name__ == "__main__":
    cli.parse(sys.argv[1:])
    from jaxmx.demo import commands

    sys.exit(commands.main(sys.argv[1:]))
