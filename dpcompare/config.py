"""Deprecated: dpcompare.config moved to dpcompare.run.config (internal) in 0.1.0. Import RunConfig from
`dpcompare`, the public API (docs/extending.md); until 0.3.0 every name here is forwarded with a warning."""

from dpcompare._moved import forward

__getattr__ = forward(__name__, "dpcompare.run.config", "RunConfig")
