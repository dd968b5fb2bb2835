"""The library's version (recorded in every pack it writes)."""

__version__ = "0.1.0"
