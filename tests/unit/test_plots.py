"""Pictures from a run's metrics: a figure per stage with the panels the stage logged, and runs of a
sweep on shared axes with the config keys that differ in the legend (`python -m rft.plot`)."""

import json
import subprocess
import sys

import pytest
import yaml

from rft.plot import draw_run
from rft.plot.figures import differing_keys, run_labels, smoothed


def _run(run_dir, seed: int, lr: float) -> str:
    """A two-stage run's files as its ranks write them: the trainer's and an engine's scalars."""
    (run_dir / "metrics").mkdir(parents=True)
    config = {"seed": seed, "run": {"output_dir": str(run_dir), "name": "qs"},
              "stages": [{"name": "sft", "algorithm": {"lr": 3e-3}}, {"name": "grpo", "algorithm": {"lr": lr}}]}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    trainer = [{"step": s, "stage": "sft", "time": 0.0, "loss/sft": 2.0 / s, "timing/step_s": 0.1} for s in range(1, 31)]
    trainer += [{"step": s, "stage": "grpo", "time": 0.0, "reward/mean": (s - 30) / 40 + seed / 100,
                 "actor/entropy": 0.8, "loss/kl": 0.0, "actor/clipfrac": 0.01, "response_length/mean": 4.0,
                 "timing/step_s": 1.0} for s in range(31, 71)]
    engine = [{"step": s, "stage": stage, "time": 0.0, "eval/accuracy": acc}
              for s, stage, acc in ((0, "sft", 0.0), (30, "sft", 0.4), (30, "grpo", 0.4), (70, "grpo", 0.6 + seed / 100))]
    for name, rows in (("trainer0", trainer), ("rollout1", engine)):
        (run_dir / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run_dir)


def test_each_stage_gets_a_png_and_an_svg_with_the_panels_it_logged(tmp_path):
    paths = draw_run(_run(tmp_path / "run", 0, 1e-3))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["grpo.png", "grpo.svg", "sft.png", "sft.svg"]
    sft = (tmp_path / "run" / "plots" / "sft.svg").read_text()
    grpo = (tmp_path / "run" / "plots" / "grpo.svg").read_text()
    assert "loss/sft" in sft and "reward/mean" not in sft and "eval/accuracy" in sft
    for key in ("reward/mean", "eval/accuracy", "response_length/mean", "actor/entropy", "actor/clipfrac",
                "timing/step_s", "stage grpo, steps 30-70"):
        assert key in grpo, key
    assert "loss/kl" not in grpo  # 0 throughout: no reference model, no panel
    assert (tmp_path / "run" / "plots" / "grpo.png").read_bytes()[:4] == b"\x89PNG"


def test_smoothing_follows_the_trend_without_lag_and_keeps_the_length():
    trend, window = smoothed([0.0] * 50 + [1.0] * 50)
    assert len(trend) == 100 and window == 7
    assert trend[46] == 0.0 and trend[53] == 1.0 and trend[49] == pytest.approx(3 / 7) and trend[-1] == 1.0


def test_a_sweep_is_one_figure_with_what_differs_in_the_legend(tmp_path):
    sweep = tmp_path / "sweep"
    runs = [_run(sweep / "0", 1, 1e-3), _run(sweep / "1", 2, 3e-3)]
    assert differing_keys(runs) == ["seed", "stages.grpo.algorithm.lr"]  # not run.output_dir
    result = subprocess.run([sys.executable, "-m", "rft.plot", str(sweep)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(sweep / "plots" / "compare.png"), str(sweep / "plots" / "compare.svg")]
    svg = (sweep / "plots" / "compare.svg").read_text()
    assert "seed=1, stages.grpo.algorithm.lr=0.001" in svg and "seed=2, stages.grpo.algorithm.lr=0.003" in svg


def test_runs_of_different_recipes_are_told_apart_by_name_and_shared_keys_come_first(tmp_path):
    runs = [_run(tmp_path / "sft_grpo", 1, 1e-3), _run(tmp_path / "chord", 1, 1e-3)]
    config = yaml.safe_load(open(f"{runs[1]}/config.yaml"))
    config["seed"] = 2
    config["stages"] = [{"name": "chord", "algorithm": {"lr": 3e-3, "mu": 0.9, "rows": 64, "phi": False}}]
    (tmp_path / "chord" / "config.yaml").write_text(yaml.safe_dump(config))
    keys = differing_keys(runs)
    assert keys[0] == "seed" and len(keys) > 3  # the one key both runs set, before the stages only one has
    labels = run_labels(runs)
    assert labels[0].startswith("sft_grpo: seed=1, ") and labels[1].startswith("chord: seed=2, ")
    assert labels[1].endswith(f"(+{len(keys) - 3} more keys differ)")


def test_a_directory_without_runs_is_named(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rft.plot", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"{tmp_path}: not a run directory" in result.stderr


def test_a_scalar_two_ranks_log_at_one_step_is_drawn_as_their_mean(tmp_path, monkeypatch):
    """Every data-parallel trainer rank logs its own `timing/step_s`; the step-time panel must draw
    their mean per step, read back from the figure's own line (a sum would double the step time).
    A step only one rank logged is that rank's value."""
    from matplotlib.figure import Figure

    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"stages": [{"name": "grpo"}]}))
    per_rank = {"trainer0": {1: 1.0, 2: 2.0, 3: 4.0, 4: 1.5}, "trainer1": {1: 3.0, 2: 2.0, 3: 1.0}}
    for rank, seconds in per_rank.items():
        rows = [{"step": s, "stage": "grpo", "time": 0.0, "timing/step_s": v, "reward/mean": 0.5}
                for s, v in seconds.items()]
        (run_dir / "metrics" / f"{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: dict[str, tuple[list, list]] = {}  # panel key -> (x, y) of its line, as the saved figure holds it
    savefig = Figure.savefig

    def read_lines_then_save(fig, *args, **kwargs):
        for ax in fig.axes:
            if ax.get_visible() and ax.lines:
                key = ax.get_title().rsplit("\n", 1)[-1]
                drawn[key] = ([int(x) for x in ax.lines[0].get_xdata()], [float(y) for y in ax.lines[0].get_ydata()])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", read_lines_then_save)  # a spy: the real figure is drawn and saved
    assert draw_run(str(run_dir))
    assert drawn["timing/step_s"] == ([1, 2, 3, 4], [2.0, 2.0, 2.5, 1.5])
    assert drawn["reward/mean"] == ([1, 2, 3, 4], [0.5, 0.5, 0.5, 0.5])
