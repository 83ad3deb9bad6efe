"""The package version, in a leaf module so that any layer can read it without importing the
package façade (``ampdoctor/__init__.py`` imports everything, lazily)."""

__version__ = "0.1.0"
