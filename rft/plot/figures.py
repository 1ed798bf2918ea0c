"""The figures: one per stage of a run (`plots/<stage>.png` and `.svg`), and several runs on shared
axes. Every panel shows the raw points faintly and a centred moving mean over them, the
smoothing named in the panel."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rft.plot.series import Curve, RunCurves, flat_config

# keys that differ between any two runs without saying how they differ
UNINFORMATIVE = ("run.output_dir", "monitor.group", "data.train_path", "data.eval_path", "model.path",
                 "hydra", "cluster.port")


@dataclass(frozen=True)
class Panel:
    keys: tuple[str, ...]  # the first of these a stage logs is drawn
    title: str
    unit: str = ""
    percent: bool = False  # a fraction drawn as %
    skip_if_zero: bool = False  # a scalar that is 0 unless a feature is on (the KL without a reference)


PANELS = (
    Panel(("reward/mean", "loss/sft", "loss/dpo"), "reward (mean per step)"),
    Panel(("eval/accuracy",), "held-out accuracy / success", "%", percent=True),
    Panel(("response_length/mean",), "response length", "tokens"),
    Panel(("actor/entropy",), "entropy", "nats per token"),
    Panel(("loss/kl",), "KL to the reference", skip_if_zero=True),
    Panel(("actor/clipfrac",), "clip fraction", "%", percent=True, skip_if_zero=True),
    Panel(("timing/step_s",), "step time", "s"),
)
SPARSE = 20  # a curve of at most this many points is drawn point to point, unsmoothed
TITLES = {"loss/sft": "SFT loss (NLL per token)", "loss/dpo": "DPO loss"}


def smoothed(values: list[float]) -> tuple[list[float], int]:
    """A centred moving mean over about a fifteenth of the curve (odd, at least 1 step; narrower
    at the ends): the trend through noisy steps without the lag of an exponential average."""
    window = max(1, round(len(values) / 15)) | 1
    half, out = window // 2, []
    for i in range(len(values)):
        part = values[max(0, i - half):i + half + 1]
        out.append(sum(part) / len(part))
    return out, window


def pick(panel: Panel, curves: dict[str, Curve]) -> str | None:
    for key in panel.keys:
        curve = curves.get(key)
        if curve is not None and curve.values and not (panel.skip_if_zero and not any(curve.values)):
            return key
    return None


def _draw(ax, panel: Panel, key: str, curve: Curve, color: str, label: str | None) -> float:
    scale = 100.0 if panel.percent else 1.0
    values = [v * scale for v in curve.values]
    if len(values) <= SPARSE:  # evaluations: every point is a measurement worth its marker
        ax.plot(curve.steps, values, "o-", ms=4, lw=1.5, color=color, label=label)
        return 1.0
    ax.plot(curve.steps, values, "o", ms=2.5, alpha=0.25, color=color)
    trend, span = smoothed(values)
    ax.plot(curve.steps, trend, "-", lw=1.8, color=color, label=label)
    return span


def _label(ax, panel: Panel, key: str, spans: list[float]) -> None:
    ax.set_title(TITLES.get(key, panel.title) + f"\n{key}", fontsize=9)
    smoothing = f" (dots: steps; line: centred mean of {max(spans):.0f})" if max(spans, default=1.0) > 1 else ""
    ax.set_xlabel("trainer step" + smoothing, fontsize=8)
    if panel.unit:
        ax.set_ylabel(panel.unit, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _figure(panels: int, title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only: ranks and login nodes have no display
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # the SVG keeps its text as text: searchable, editable

    cols = min(4, max(panels, 1))
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows + 0.6), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    return plt, fig, list(axes.flat)


def _save(plt, fig, path: str, legend_room: float = 0.0) -> list[str]:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout(rect=(0, legend_room, 1, 1))
    base = os.path.splitext(path)[0]
    paths = [f"{base}.png", f"{base}.svg"]
    fig.savefig(paths[0], dpi=110)
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def stage_figure(run: RunCurves, stage: str, path: str) -> list[str]:
    """The stage's panels into `path` (.png and .svg); the paths written ([] if it logged nothing)."""
    curves = run.stage(stage)
    drawn = [(panel, key) for panel in PANELS if (key := pick(panel, curves)) is not None]
    if not drawn:
        return []
    steps = [s for c in curves.values() for s in c.steps]
    plt, fig, axes = _figure(len(drawn), f"{os.path.basename(os.path.normpath(run.run_dir))}: stage {stage}, "
                                          f"steps {min(steps)}-{max(steps)}")
    for ax, (panel, key) in zip(axes, drawn):
        _label(ax, panel, key, [_draw(ax, panel, key, curves[key], "tab:blue", None)])
    return _save(plt, fig, path)


LEGEND_KEYS = 3  # differing keys named per run in the legend


def differing_keys(run_dirs: list[str]) -> list[str]:
    """The config keys whose values differ between the runs (what a sweep varied): first those
    every run sets, then those only some set (runs with other stages), each group sorted."""
    configs = [flat_config(d) for d in run_dirs]
    keys = sorted(set().union(*configs), key=lambda k: (not all(k in c for c in configs), k))
    return [k for k in keys if not k.startswith(UNINFORMATIVE) and not k.endswith(UNINFORMATIVE)
            and len({c.get(k) for c in configs}) > 1]


def run_labels(run_dirs: list[str]) -> list[str]:
    """`key=value, ...` of the differing keys per run. The directory's name where nothing differs,
    and in front where more keys differ than the legend names (runs of different recipes, told
    apart by their names rather than by three of their keys)."""
    keys = differing_keys(run_dirs)
    labels = []
    for run_dir in run_dirs:
        config = flat_config(run_dir)
        name = os.path.basename(os.path.normpath(run_dir))
        text = ", ".join(f"{k}={config.get(k, '-')[:24]}" for k in keys[:LEGEND_KEYS])
        if len(keys) > LEGEND_KEYS:
            text = f"{name}: {text} (+{len(keys) - LEGEND_KEYS} more keys differ)"
        labels.append(text or name)
    return labels


def compare_figure(runs: list[RunCurves], path: str) -> list[str]:
    """Every run's whole curve (all stages, global steps) on shared axes, one colour per run."""
    drawn = []
    for panel in PANELS:
        key = next((k for k in panel.keys if any(pick(Panel((k,), "", skip_if_zero=panel.skip_if_zero),
                                                          {k: r.whole_run(k)}) for r in runs)), None)
        if key is not None:
            drawn.append((panel, key))
    labels = run_labels([r.run_dir for r in runs])
    plt, fig, axes = _figure(max(len(drawn), 1), f"{len(runs)} runs")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, key) in zip(axes, drawn):
        spans = [_draw(ax, panel, key, r.whole_run(key), colors[i % len(colors)], labels[i])
                 for i, r in enumerate(runs) if r.whole_run(key).values]
        _label(ax, panel, key, spans)
    legend = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=1, fontsize=8)
    return _save(plt, fig, path, legend_room=min(0.35, 0.035 * len(legend) + 0.02))
