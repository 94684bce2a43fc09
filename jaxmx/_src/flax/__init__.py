"""The Flax integration's implementation (public names: ``jaxmx.flax``)."""
