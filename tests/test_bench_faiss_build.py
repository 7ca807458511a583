"""``python -m genrec.app.bench.faiss_build``: both samples build, recall is measured against
exact search, and the JSON says how many items each k-means trained on (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from genrec.app.bench.faiss_build import main


def test_side_by_side_builds_report_training_points_and_recall(tmp_path: Path, capsys) -> None:
    out = tmp_path / "faiss.json"
    assert main(["--items", "20000", "--dim", "16", "--queries", "100", "--points-per-list",
                 "256,39", "--json", str(out)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    first, second = report["rows"]
    assert first["nlist"] == second["nlist"] == 512  # n // 39 caps 4 sqrt(n) = 565
    assert first["train_points"] == 20000 and second["train_points"] == 39 * 512
    assert min(first["recall@10"], second["recall@10"]) > 0.5
    assert "build 256 / 39 a list:" in capsys.readouterr().out
