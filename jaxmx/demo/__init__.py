"""The jaxmx demo: ``python -m jaxmx.demo`` trains a byte-level transformer in BF16 and in MXFP8.

Modules: :mod:`~jaxmx.demo.cli` (the command line, argparse only) and
:mod:`~jaxmx.demo.config` (the settings and recipe names), :mod:`~jaxmx.demo.commands` (what the
command runs), :mod:`~jaxmx.demo.data` (pydoc topics as bytes), :mod:`~jaxmx.demo.model` (nnx
transformer), :mod:`~jaxmx.demo.train` (training loop, BF16 vs MXFP8 comparison) and
:mod:`~jaxmx.demo.report` (table and plot), with :mod:`~jaxmx.demo.diagnose` (``--diagnose``
telemetry heat maps), :mod:`~jaxmx.demo.losses` (the loss and rounding context that ``train``
and ``diagnose`` share) and :mod:`~jaxmx.demo.serve` (``python -m jaxmx.demo generate``: greedy
decoding with a KV cache, BF16 vs MX weights at rest and an MX cache). Needs the demo extras:
``pip install -e ".[demo]"`` in the root of a jaxmx clone.
"""
