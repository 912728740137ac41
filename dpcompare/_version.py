"""The one place the version is set (pyproject.toml reads it from here), and the result schema's version."""

__version__ = "0.2.0"
SCHEMA_VERSION = 1
"""Version of the JSON result schema (dpcompare/schema/result.schema.json)."""
