"""dpcompare: one model, one data stream, four data-parallel backends, one float64 oracle."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
