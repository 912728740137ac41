"""Packages are found, not listed: every package under dpcompare/, and adapters/ shipped as dpcompare.adapters (the
top-level name `adapters` belongs to AdapterHub on PyPI). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["dpcompare", "dpcompare.*"]), "dpcompare.adapters"],
      package_dir={"dpcompare.adapters": "adapters"})
