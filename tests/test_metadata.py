"""Metadata a person reads: rates as percentages, rounded numbers, whole numbers whole, blanks for what does not apply."""

import math

from rlvr_assets import metadata


def test_rates_are_percentages_and_other_numbers_are_rounded():
    assert metadata.readable("pass@1_strict", 0.11333333333333334) == "11.3%"
    assert metadata.readable("pass@1_strict_ci_low", 2.77556e-17) == "0.0%"
    assert metadata.readable("delta_pass@1_strict", 0.02) == "+2.0%"
    assert metadata.readable("format_delta", -0.04) == "-4.0%"
    assert metadata.readable("final_truncation_rate", 0.5625) == "56.2%"
    assert metadata.readable("final_loss", -0.0000014603) == "-1.46e-06"
    assert metadata.readable("mean_completion_tokens", 167.78) == "168"
    assert metadata.readable("mcnemar_p_value", 0.0412345) == "0.0412"
    assert metadata.readable("num_problems", 50.0) == "50"
    assert metadata.readable("group", 2.0) == "2"
    assert metadata.readable("p_value", math.nan) == "" and metadata.readable("verdict", None) == ""
    assert metadata.readable("reused", True) == "yes"


def test_rounded_and_percent_are_numbers():
    assert metadata.rounded(2.77556e-17) == 0.0 and metadata.rounded(-0.0000014603) == -1.46e-06
    assert metadata.percent(0.11333333333333334) == 11.3 and str(metadata.percent(-0.0)) == "0.0"


def test_tables_hold_every_row_and_leave_blanks_for_what_does_not_apply():
    stages = [{"stage": "base", "pass@1_strict": 0.02, "format_compliance": 0.42}, {"stage": "GRPO", "pass@1_strict": 0.04, "delta": 0.02, "p_value": 1.0}]
    text = metadata.markdown_table(stages, labels={"pass@1_strict": "pass@1"}).value
    lines = text.splitlines()
    assert lines[0] == "| stage | pass@1 | format_compliance | delta | p_value |"
    assert lines[2] == "| base | 2.0% | 42.0% |  |  |" and lines[3] == "| GRPO | 4.0% |  | +2.0% | 1 |"
    assert "nan" not in text
    table = metadata.metrics_table({"base": {"pass@1_strict": 0.02}, "trained": {"pass@1_strict": 0.04, "mean_reward_total": 0.0867}}).value
    assert "| pass@1_strict | 2.0% | 4.0% |" in table and "| mean_reward_total | – | 0.0867 |" in table
