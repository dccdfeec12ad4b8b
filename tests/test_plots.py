"""The report's figures read right: the loss on its own axis, percentages clear of the error bars, whole steps."""

from rlvr import plots


def test_the_loss_gets_its_own_axis_so_the_reward_curve_is_not_flattened():
    curves = {"reward_mean": [(1, 0.04), (2, 0.07), (3, 0.1)], "format_mean": [(1, 0.4), (2, 0.5), (3, 0.6)], "loss": [(1, -1.4e-6), (2, 2e-7), (3, 1e-6)]}
    fig = plots.curves_figure(curves)
    top, bottom = fig.axes
    assert [line.get_label() for line in top.get_lines()] == ["reward_mean", "format_mean"]
    assert [line.get_label() for line in bottom.get_lines()] == ["loss"]
    low, high = bottom.get_ylim()
    assert high - low < 1e-5  # the loss's scale, not the rewards'
    assert top.get_ylim()[1] - top.get_ylim()[0] < 1  # the rewards' scale
    assert plots.figure_png(fig).startswith(b"\x89PNG")


def test_curves_without_a_loss_and_without_points_are_one_panel():
    assert len(plots.curves_figure({"psi": [(1, 0.1), (2, 0.3)]}).axes) == 1
    assert len(plots.curves_figure({}).axes) == 1


def test_accuracy_labels_sit_above_the_error_bars():
    rows = [("base", 0.02, 0.0, 0.06), ("trained", 0.113, 0.06, 0.2)]
    fig = plots.accuracy_figure(rows)
    ax = fig.axes[0]
    labels = {t.get_text(): t.get_position()[1] for t in ax.texts}
    assert set(labels) == {"2.0%", "11.3%"}
    assert labels["2.0%"] > 0.06 and labels["11.3%"] > 0.2  # above each CI's upper end
    assert ax.get_ylim()[1] > max(labels.values())


def test_reasoning_steps_are_whole_numbers_on_the_axis():
    rows = [{"group": g, "accuracy": 0.1 * g, "ci_low": 0.0, "ci_high": 0.2 * g} for g in (2, 3, 4)]
    fig = plots.grouped_accuracy_figure({"base": rows, "trained": rows})
    fig.canvas.draw()
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert ticks and all(text.lstrip("−-").isdigit() for text in ticks), ticks
