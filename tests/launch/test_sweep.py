"""Issue 36: seeds (and the shuffled-reward control) as a sweep axis. ``python -m polar_gym.launch -m KEY=A,B``
runs each job in ``out_dir/<its swept overrides>`` (they all composed the same out_dir: the second SFT job wrote
over the first one's files, and Hydra left empty multirun/DATE/TIME/N folders behind), validates every job before
the first starts (nothing created on a bad value), refuses a job whose folder holds an earlier run, and goes on
after a failing job with the highest exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from polar_gym.launch import CONF_DIR, main
from polar_gym.launch.sweep import MAX_NAME, Sweep
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES

ROOT = Path(__file__).resolve().parents[2]


def _main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["polar_gym.launch", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    return int(exit_.value.code or 0)


def test_a_sweep_expands_as_hydra_does_and_names_each_job_by_its_swept_overrides() -> None:
    sweep = Sweep.parse(["-m", "+trainer=grpo", "trainer.seed=0,1", "trainer.shuffle_rewards=false,true",
                         "out_dir=runs/arms"])
    assert sweep is not None and sweep.swept == ["trainer.seed", "trainer.shuffle_rewards"]
    assert [sweep.name(job, num) for num, job in enumerate(sweep.jobs)] == [  # Hydra writes false as False
        "trainer.seed=0,trainer.shuffle_rewards=False", "trainer.seed=0,trainer.shuffle_rewards=True",
        "trainer.seed=1,trainer.shuffle_rewards=False", "trainer.seed=1,trainer.shuffle_rewards=True"]
    assert all("+trainer=grpo" in job and "out_dir=runs/arms" in job for job in sweep.jobs)
    cfg = OmegaConf.create({"out_dir": "runs/arms"})
    assert sweep.out_dir(cfg, sweep.jobs[3], 3) == Path("runs/arms/trainer.seed=1,trainer.shuffle_rewards=True")
    assert cfg.out_dir == "runs/arms/trainer.seed=1,trainer.shuffle_rewards=True"

    # a group swept with +, a path value (its / cannot be in a folder name), nothing swept, a name too long
    paths = Sweep.parse(["--multirun", "+trainer=sft,grpo", "trainer.model=/m/a,/m/b"])
    assert paths is not None
    assert [paths.name(job, n) for n, job in enumerate(paths.jobs)] == [
        "+trainer=sft,trainer.model=_m_a", "+trainer=sft,trainer.model=_m_b",
        "+trainer=grpo,trainer.model=_m_a", "+trainer=grpo,trainer.model=_m_b"]
    single = Sweep.parse(["-m", "trainer.seed=3"])
    assert single is not None and single.name(single.jobs[0], 0) == "0"
    long = "x" * MAX_NAME
    wide = Sweep.parse(["-m", f"+tasks.note={long},b"])
    assert wide is not None and [wide.name(job, n) for n, job in enumerate(wide.jobs)] == ["0", "+tasks.note=b"]

    # not a sweep, or a Hydra flag that prints instead of running: Hydra's own way
    assert Sweep.parse(["trainer.seed=0,1"]) is None
    assert Sweep.parse(["-m", "--cfg", "job", "trainer.seed=0,1"]) is None


def test_sweeping_out_dir_or_values_that_share_a_folder_is_refused() -> None:
    swept = Sweep.parse(["-m", "out_dir=a,b"])
    assert swept is not None and swept.problems(CONF_DIR) == [
        "out_dir: a sweep's jobs each get a folder of their own under out_dir (named by their swept overrides): give "
        "the sweep's folder as one out_dir=DIR, not a list"]
    clash = Sweep.parse(["-m", "+tasks.note=a/b,a_b"])
    assert clash is not None
    clash.validate = False
    assert clash.problems(CONF_DIR) == [
        "job #1 (+tasks.note=a_b): its folder '+tasks.note=a_b' is job #0's too (the values differ only in "
        "characters a file name cannot hold); rename the values"]


def test_a_bad_value_in_one_job_runs_nothing_and_creates_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "arms"
    assert _main(monkeypatch, "-m", "+trainer=sft", "trainer.data=[x.jsonl]", "trainer.seed=0,zero",
                 f"out_dir={out}") == 2
    err = capsys.readouterr().err
    assert "configuration error: nothing was run:" in err
    assert ("job #1 (trainer.seed=zero): trainer.seed: input should be a valid integer, unable to parse string as an "
            "integer") in err
    assert "job #0" not in err
    assert list(tmp_path.iterdir()) == []  # no out_dir, no Hydra multirun/ folder

    assert _main(monkeypatch, "-m", "+trainer=sft", "trainer.data=[x.jsonl]", "trainer.sed=0,1",
                 f"out_dir={out}") == 2
    assert "job #0 (trainer.sed=0): trainer.sed: not a config key of polar_gym.launch" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_job_whose_folder_holds_an_earlier_run_is_refused_before_any_job_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arms"
    earlier = out / "trainer.seed=1"
    earlier.mkdir(parents=True)
    (earlier / "results.jsonl").write_text("")
    assert _main(monkeypatch, "-m", "+trainer=sft", "trainer.data=[x.jsonl]", "trainer.seed=0,1",
                 f"out_dir={out}") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"job #1 (trainer.seed=1): out_dir: {earlier} holds an earlier run (results.jsonl); pick another out_dir, "
            "or add resume=true to resume it") in err
    assert sorted(p.name for p in out.iterdir()) == ["trainer.seed=1"]  # job #0 did not run


def test_a_failing_job_does_not_stop_the_sweep_and_ctrl_c_does(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    sweep = Sweep.parse(["-m", "trainer.seed=0,1,2"])
    assert sweep is not None
    codes: list[int | Exception] = [RuntimeError("boom"), 3, 0]

    def run(cfg: object) -> int:
        code = codes.pop(0)
        if isinstance(code, Exception):
            raise code
        return code

    for num, job in enumerate(sweep.jobs):
        sweep.run_job(OmegaConf.create({"out_dir": str(tmp_path)}), job, num, run)
    assert [(j.num, j.code, j.out_dir.name) for j in sweep.ended] == [
        (0, 1, "trainer.seed=0"), (1, 3, "trainer.seed=1"), (2, 0, "trainer.seed=2")]
    assert sweep.code == 3
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and f"job #0 ({tmp_path / 'trainer.seed=0'}) failed" in err
    assert sweep.summary().splitlines()[:2] == ["polar_gym.launch: sweep of 3 job(s):",
                                                f"  #0 exit 1  {tmp_path / 'trainer.seed=0'}"]

    with pytest.raises(SystemExit) as stopped:
        sweep.run_job(OmegaConf.create({"out_dir": str(tmp_path)}), sweep.jobs[0], 0, lambda cfg: 130)
    assert stopped.value.code == 130


@pytest.mark.slow
def test_two_seeds_of_sft_as_one_sweep_each_in_its_own_out_dir(tmp_path: Path) -> None:
    """The real command line: Hydra's multirun, two SFT jobs on a tiny model (no engine)."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n")
    model, out = small_qwen3_dir(tmp_path), tmp_path / "arms"
    proc = subprocess.run(
        [sys.executable, "-m", "polar_gym.launch", "-m", "+trainer=sft", f"trainer.model={model}",
         f"trainer.data=[{data}]", "trainer.steps=1", "trainer.batch_size=1", "trainer.seed=0,1", f"out_dir={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for seed in (0, 1):
        job = out / f"trainer.seed={seed}"
        rows = [json.loads(x) for x in (job / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1]
        config = yaml.safe_load((job / "config.yaml").read_text())
        assert config["trainer"]["seed"] == seed and config["out_dir"] == str(job)
    assert sorted(p.name for p in out.iterdir()) == ["multirun.yaml", "trainer.seed=0", "trainer.seed=1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arms", "small-qwen3", "train.jsonl"]  # no multirun/
    assert f"#1 exit 0  {out / 'trainer.seed=1'}" in proc.stderr
    assert "compare them: python -m polar_gym.report.compare" in proc.stderr
