"""``python -m polar_gym.report.compare``: training runs (treatment seeds, the shuffled-reward control) on the same
axes with their 95 % bands, named by what differs in their configs, a table of each run's first and last step and
steps trained; a folder that is not a training run is refused naming it (exit 2). Synthetic run folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from polar_gym.plots import PALETTE
from polar_gym.report.compare import KEYS, Run, arm_names, differences, main, steps_trained

CONFIG: dict[str, Any] = {"num_samples": 8, "out_dir": "", "trainer": {"algorithm": "grpo", "seed": 0,
                                                                       "shuffle_rewards": False, "steps": 3},
                          "launcher": {"run_slots": 4}, "logging": {"wandb": {"enabled": False}}}


def _run(root: Path, name: str, *, seed: int, shuffle: bool, slope: float, trained: bool = True,
         run_slots: int = 4) -> Path:
    """A GRPO run's folder as the launch leaves it: config.yaml and trainer/train_metrics.jsonl (a step-0 row of
    evaluations, then steps 1..3 with rewards and their standard errors)."""
    out = root / name
    (out / "trainer").mkdir(parents=True)
    config = json.loads(json.dumps(CONFIG))
    config["out_dir"] = str(out)
    config["trainer"].update(seed=seed, shuffle_rewards=shuffle)
    config["launcher"]["run_slots"] = run_slots
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    rows: list[dict[str, Any]] = [{"step": 0, "eval/share_right": 0.5, "eval/p_right": 0.2}]
    rows += [{"step": s, "eval/share_right": 0.5 + slope * s, "eval/p_right": 0.2 + slope * s,
              "reward_mean": 0.4 + slope * s, "reward_se": 0.05, "reward_n": 8, "loss": 0.1,
              "trained": trained or s == 1, "not_trained_reasons": [] if trained or s == 1 else ["no_signal"]}
             for s in (1, 2, 3)]
    (out / "trainer" / "train_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _figure(page: str) -> str:
    return page[page.index('<figure id="fig-compare">'):page.index("</figure>")]


def test_treatment_seeds_and_a_control_on_one_page_named_by_their_differences(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run(tmp_path / "arms", "trainer.seed=0", seed=0, shuffle=False, slope=0.1),
            _run(tmp_path / "arms", "trainer.seed=1", seed=1, shuffle=False, slope=0.08, run_slots=8),
            _run(tmp_path / "arms", "control", seed=0, shuffle=True, slope=0.0, trained=False)]
    out = tmp_path / "compare.html"
    assert main([*map(str, runs), "--out", str(out)]) == 0
    names = ["seed=0 shuffle_rewards=false", "seed=1 shuffle_rewards=false", "seed=0 shuffle_rewards=true"]
    assert capsys.readouterr().out.startswith(f"compare: {out} (3 runs: {'; '.join(names)};")
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Content-Security-Policy" in page and "<script" not in page

    figure = _figure(page)
    panels = [k for k in KEYS if f">{k}<" in figure or f">{k} (band: 95 % interval)<" in figure]
    assert panels == ["eval/share_right", "eval/p_right", "reward_mean"]  # no run has greedy_success: no panel
    for name, colour in zip(names, (PALETTE["blue"], PALETTE["orange"], PALETTE["green"]), strict=True):
        assert figure.count(f">{name}<") == 3  # in each panel's legend
        # its line in each panel, and its legend's sample of it
        assert figure.count(f"stroke: {colour}; stroke-width: 1.5") == 2 * 3
    assert page.count("fill-opacity: 0.18") == 3  # reward_mean's band (from reward_se), one per run
    assert ">eval/greedy_success<" not in page

    runs_table = page[page.index('<section id="runs">'):page.index('<section id="differences">')]
    for name, trained, share in zip(names, ("3 of 3", "3 of 3", "1 of 3"), ("0.500 → 0.800", "0.500 → 0.740",
                                                                                  "0.500 → 0.500"), strict=True):
        row = runs_table[runs_table.index(f"<td>{name}</td>"):]
        row = row[:row.index("</tr>")]
        assert f"{trained} steps trained" in row and "0 → 3" in row and share in row
        assert row.endswith(" (from step 1)</td>")  # reward_mean: step 0 only evaluates
    # a run whose steps did not all train says so at the top, under its name
    assert ('<p class="banner bad">seed=0 shuffle_rewards=true: GRPO: 1 of 3 steps trained — every group&#x27;s '
            "rewards were equal (no signal)</p>") in page
    differs = page[page.index('<section id="differences">'):]
    assert "<td>trainer.seed</td>" in differs and "<td>trainer.shuffle_rewards</td>" in differs
    assert "run_slots" not in differs and "out_dir" not in differs  # where a run ran is not what it trained


def test_names_given_or_from_the_folder_when_nothing_differs(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", seed=0, shuffle=False, slope=0.1)
    b = _run(tmp_path, "b", seed=0, shuffle=False, slope=0.1)
    out = tmp_path / "c.html"
    assert main([str(a), "--name", f"treatment={b}", "--out", str(out), "--title", "Fork <calc-add>"]) == 0
    page = out.read_text()
    assert ">a<" in page and ">treatment<" in page and "<h1>Fork &lt;calc-add&gt;</h1>" in page
    assert "do not differ" in page

    same = [Run(Path("x/r"), [{}], {"trainer.seed": 1}), Run(Path("y/r2"), [{}], {"trainer.seed": 1})]
    assert arm_names(same) == ["r", "r2"]
    twins = [Run(Path("x/r"), [{}], {"k": 1}), Run(Path("y/s"), [{}], {"k": 2}), Run(Path("z/t"), [{}], {"k": 2})]
    assert arm_names(twins, {Path("x/r"): "k=2"}) == ["k=2 (r)", "k=2 (s)", "k=2 (t)"]
    # the last part of a key names it unless two differing keys share it; an absent key is a difference
    configs = [{"a.seed": 0, "b.seed": 0, "c": "x"}, {"a.seed": 1, "b.seed": 2}]
    assert differences(configs) == ["a.seed", "b.seed", "c"]
    runs = [Run(Path(str(i)), [{}], c) for i, c in enumerate(configs)]
    assert arm_names(runs) == ["a.seed=0 b.seed=0 c=x", "a.seed=1 b.seed=2 c=unset"]


def test_steps_trained_counts_from_step_one_and_a_row_without_a_verdict_as_trained() -> None:
    assert steps_trained([{"step": 0}, {"step": 1, "trained": False}, {"step": 2, "trained": True}]) == (1, 2)
    assert steps_trained([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]) == (2, 2)  # SFT


def test_a_missing_or_empty_run_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _run(tmp_path, "good", seed=0, shuffle=False, slope=0.1)
    empty = tmp_path / "empty"
    (empty / "trainer").mkdir(parents=True)
    (empty / "trainer" / "train_metrics.jsonl").write_text("\n")
    not_training = tmp_path / "datagen"
    not_training.mkdir()
    out = tmp_path / "c.html"
    assert main([str(good), str(empty), str(not_training), str(tmp_path / "gone"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{empty / 'trainer' / 'train_metrics.jsonl'}: no rows (did the run train a step?)" in err
    assert f"{not_training}: no trainer/train_metrics.jsonl (the out_dir of a training run" in err
    assert f"{tmp_path / 'gone'}: no such folder" in err
    assert not out.exists()
    assert main(["--out", str(out)]) == 2 and "no RUN_DIR given" in capsys.readouterr().err
    assert main([str(good), "--name", "noequals", "--out", str(out)]) == 2
    assert "--name 'noequals': give NAME=RUN_DIR" in capsys.readouterr().err
    (empty / "trainer" / "train_metrics.jsonl").write_text("{not json\n")
    assert main([str(empty), "--out", str(out)]) == 2 and "cannot be read (JSONDecodeError" in capsys.readouterr().err
    assert KEYS == ["eval/share_right", "eval/p_right", "reward_mean", "eval/greedy_success"]
