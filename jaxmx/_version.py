"""The one version string of jaxmx (read by the build too)."""

__version__ = "0.1.0"
