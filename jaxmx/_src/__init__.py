"""jaxmx's implementation. Not a public API: import names from ``jaxmx`` and its public modules."""
