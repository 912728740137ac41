"""experiments/identity_runs.py's comparison: a result that differs only where two launches of one cell differ (times,
memory, its folder) is identical; a verdict's figure changed is not, and the comparison exits 1 naming its key."""

from __future__ import annotations

import json
from pathlib import Path

from experiments import identity_runs


def _write(root: Path, cell: str, payload: dict) -> None:
    (root / cell).mkdir(parents=True, exist_ok=True)
    (root / cell / "r.json").write_text(json.dumps(payload).replace("{out}", str(root)))


def _set(root: Path, ratio: float, ms: float) -> Path:
    for cell in identity_runs.CELLS:
        again = cell in identity_runs.AGAIN.values()
        _write(root, cell, {"equivalence": {"verdict": "equivalent", "noise_ratio": ratio},
                            "config": {"out": f"{{out}}/{cell}", "save_checkpoint": "{out}/ckpt"},
                            "metrics": {"verify_ms_by_part": {"gradient": ms + again, "update": ms * 2 + again},
                                        "verify_setup_ms": ms + again}})
    return root


def test_results_that_differ_only_in_times_and_folders_are_identical(tmp_path: Path, capsys) -> None:
    before, after = _set(tmp_path / "before", 1.25, 10.0), _set(tmp_path / "after", 1.25, 99.0)
    _write(after, "ddp-clip", {**json.loads((after / "ddp-clip" / "r.json").read_text()),
                               "metrics": {"verify_ms_by_part": {"grad_norm": 3.0}, "verify_setup_ms": 1.0}})
    assert identity_runs.compare(before, after) == 0
    assert "differs" not in capsys.readouterr().out


def test_a_changed_figure_of_the_verdict_is_found(tmp_path: Path, capsys) -> None:
    before, after = _set(tmp_path / "before", 1.25, 10.0), _set(tmp_path / "after", 1.25, 10.0)
    changed = json.loads((after / "zero3" / "r.json").read_text())
    changed["equivalence"]["noise_ratio"] = 1.2500001
    (after / "zero3" / "r.json").write_text(json.dumps(changed))
    assert identity_runs.compare(before, after) == 1
    assert "zero3: differs at .equivalence.noise_ratio" in capsys.readouterr().out
