"""reference: one process, no wrapper. The plain single-process run every backend is held against."""

from __future__ import annotations

from dpcompare import Adapter, Capabilities


class ReferenceAdapter(Adapter):
    name = "reference"
    capabilities = Capabilities(
        multi_process=False,
        launchers=frozenset({"python"}),
        launch_hint="python -m dpcompare --backend reference",
        scaling_baseline=True,
        compiles=True,
    )
