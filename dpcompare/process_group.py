"""Deprecated: dpcompare.process_group moved to dpcompare.run.process_group (internal) in 0.1.0. Import ProcessGroupMixin and DIST_BACKEND from
`dpcompare`, the public API (docs/extending.md); until 0.3.0 every name here is forwarded with a warning."""

from dpcompare._moved import forward

__getattr__ = forward(__name__, "dpcompare.run.process_group", "ProcessGroupMixin and DIST_BACKEND")
