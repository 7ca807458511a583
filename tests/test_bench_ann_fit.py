"""``python -m genrec.app.bench.ann_fit`` on a tiny workload: every fit reported, the
whole-catalog fit shares all of its own top-50, landmarks are a bounded fit."""

import json

from genrec.app.bench.ann_fit import main


def test_ann_fit_bench_reports_each_fit(tmp_path, capsys):
    out = tmp_path / "ann_fit.json"
    main(["--users", "200", "--items", "400", "--events", "4000", "--landmarks", "100",
          "--eval-users", "50", "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    whole, landmarks = report["fits"]
    assert whole["landmarks"] == "whole catalog" and whole["top50_shared_with_whole"] == 1.0
    assert landmarks["landmarks"] == 100 and 0 <= landmarks["top50_shared_with_whole"] <= 1
    assert 0 <= landmarks["hr_at_10"] <= 1 and report["eval_users"] == 50
    assert 0 <= report["unseen_rows"] <= landmarks["zero_rows"]
