"""launcher=slurm without Slurm: its config validates, and the commands its jobs run are built right."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from polar_gym.assets import tokenizer_dir
from polar_gym.launch import CONF_DIR, ConfigError, InferenceSettings, build_job, build_launcher
from polar_gym.launch.jobs import (
    GatewayJobSettings,
    InferenceJobSettings,
    advertised_host,
    gateway_argv,
    inference_command,
)
from polar_gym.launch.placement import (
    PlacementSettings,
    controller_address,
    job_kind,
    launcher_host,
    placement_parameters,
    route_address,
    running_nodes,
)
from polar_gym.launch.submitit_launcher import SlurmLauncher


def _launcher(*overrides: str) -> SlurmLauncher:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["launcher=slurm", *overrides])
    launcher = build_launcher(cfg)
    assert isinstance(launcher, SlurmLauncher)
    return launcher


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_slurm_launcher_config_composes_with_its_defaults() -> None:
    launcher = _launcher("launcher.gateways=3", "launcher.partition=cpu", "+launcher.additional_parameters.qos=high")
    assert launcher.gateways == 3 and launcher.server_mode == "local" and launcher.cluster == "slurm"
    assert launcher.slurm == {"slurm_partition": "cpu", "slurm_additional_parameters": {"qos": "high"}}
    assert launcher.gateway.run_slots == 8 and launcher.inference_jobs.count == 0


@pytest.mark.parametrize(("override", "message"), [
    ("launcher.gateways=0", "launcher.gateways: input should be greater than or equal to 1"),
    ("launcher.server=elsewhere", "launcher.server: input should be 'local' or 'job'"),
    ("+launcher.gateway.colour=red", "launcher.gateway.colour: extra inputs are not permitted"),
    ("launcher.inference_jobs.kind=tgi", "launcher.inference_jobs.kind"),
    ("launcher.gateway.run_slots=0", "launcher.gateway.run_slots"),
])
def test_bad_slurm_launcher_settings_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _launcher(override)


def test_inference_jobs_stand_in_for_upstreams_in_validation(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        without = compose("config", overrides=["launcher=slurm", "inference=vllm", "inference.upstreams=[]",
                                               f"out_dir={tmp_path}"])
        with_jobs = compose("config", overrides=["launcher=slurm", "inference=vllm", "inference.upstreams=[]",
                                                 "launcher.inference_jobs.count=2", f"out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="needs at least one upstream URL"):
        build_job(without)
    assert build_job(with_jobs).inference.engine == "vllm"


def test_gateway_argv_carries_the_engine_pools_server_and_upstreams(tmp_path: Path) -> None:
    inference = InferenceSettings(engine="vllm", upstreams=["http://a:8000"], upstream_model="m",
                                  max_tokens_cap=64, policy_version=3)
    pools = GatewayJobSettings(run_slots=16, init_workers=6)
    argv = gateway_argv(inference, pools, ["http://a:8000", "http://b:30000"], server_url="http://srv:8700",
                        workdir=tmp_path / "gw", heartbeat=1.5)
    assert _flag(argv, "--engine") == "vllm" and _flag(argv, "--server-url") == "http://srv:8700"
    assert argv[argv.index("--upstream") + 1:argv.index("--upstream") + 3] == ["http://a:8000", "http://b:30000"]
    assert (_flag(argv, "--run-slots"), _flag(argv, "--init-workers"), _flag(argv, "--heartbeat")) == ("16", "6", "1.5")
    assert (_flag(argv, "--upstream-model"), _flag(argv, "--max-tokens-cap"), _flag(argv, "--policy-version")) == \
        ("m", "64", "3")
    assert _flag(argv, "--capture-dir") == str(tmp_path / "gw" / "capture") and _flag(argv, "--host") == "0.0.0.0"
    assert "--tokenizer" not in argv and "--port" not in argv  # the port is picked on the node
    assert "--await-upstreams" not in argv
    waiting = gateway_argv(InferenceSettings(engine="vllm", await_upstreams=True), pools, [],
                           server_url="http://srv:8700", workdir=tmp_path, heartbeat=1.0)
    assert "--await-upstreams" in waiting and "--upstream" not in waiting


def test_the_oracle_gateway_gets_the_built_tokenizer(tmp_path: Path) -> None:
    argv = gateway_argv(InferenceSettings(), GatewayJobSettings(), [], server_url="http://s:1", workdir=tmp_path,
                        heartbeat=2.0)
    assert _flag(argv, "--tokenizer") == str(tokenizer_dir()) and "--upstream" not in argv
    # issue 41: a token_in gateway is told its mode and the tokenizer the launch resolved, never left to its cache
    token_in = gateway_argv(InferenceSettings(engine="vllm", upstreams=["http://a:8000"], prompt_mode="token_in"),
                            GatewayJobSettings(), [], server_url="http://s:1", workdir=tmp_path, heartbeat=2.0)
    assert (_flag(token_in, "--prompt-mode"), _flag(token_in, "--tokenizer")) == ("token_in", str(tokenizer_dir()))
    chat = gateway_argv(InferenceSettings(engine="vllm", upstreams=["http://a:8000"]), GatewayJobSettings(), [],
                        server_url="http://s:1", workdir=tmp_path, heartbeat=2.0)
    assert "--tokenizer" not in chat and "--prompt-mode" not in chat  # chat on the node as in the launch


def test_inference_commands() -> None:
    sglang, env = inference_command(InferenceJobSettings(kind="sglang", model_path="/m", gpus_per_node=4,
                                                         python="/opt/sg/bin/python", args=["--mem-fraction", "0.8"],
                                                         env={"NCCL_DEBUG": "WARN"}), 30000)
    assert sglang[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"]
    assert (_flag(sglang, "--model-path"), _flag(sglang, "--port"), _flag(sglang, "--tp-size")) == ("/m", "30000", "4")
    assert sglang[-2:] == ["--mem-fraction", "0.8"] and env == {"NCCL_DEBUG": "WARN"}
    vllm, _ = inference_command(InferenceJobSettings(kind="vllm", model_path="/m", gpus_per_node=2), 8000)
    assert "vllm.entrypoints.openai.api_server" in vllm and _flag(vllm, "--tensor-parallel-size") == "2"
    tiny, tiny_env = inference_command(InferenceJobSettings(kind="tiny_vllm"), 8001)
    assert _flag(tiny, "--port") == "8001" and _flag(tiny, "--host") == "0.0.0.0"
    assert tiny_env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in tiny_env
    assert tiny_env["OMP_WAIT_POLICY"] == "PASSIVE"  # its OpenMP threads do not spin on the node's shared cores
    assert _flag(tiny, "--dtype") == "bfloat16" and "--worker-extension-cls" not in tiny
    assert "VLLM_SERVER_DEV_MODE" not in tiny_env  # its development routes stay closed unless asked for
    train, train_env = inference_command(InferenceJobSettings(kind="tiny_vllm", dtype="float32", weight_updates=True),
                                         8002)
    assert _flag(train, "--dtype") == "float32"
    assert _flag(train, "--worker-extension-cls") == "polar_vllm_worker.WeightReload"
    assert train_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (Path(train_env["PYTHONPATH"]) / "polar_vllm_worker.py").exists()
    with pytest.raises(ValueError, match="model_path is required"):
        inference_command(InferenceJobSettings(kind="sglang"), 1)


# -- placement (launcher.placement) --------------------------------------------------------------------------------


def test_placement_adds_each_kinds_options_over_the_common_ones() -> None:
    placement = PlacementSettings(server={"nodelist": "n1"}, gateway={"exclude": "gpu[1-8]", "constraint": "cpu"})
    common = {"constraint": "any", "exclusive": True}
    assert placement_parameters(placement, "server", common, {}) == {"constraint": "any", "exclusive": True,
                                                                     "nodelist": "n1"}
    assert placement_parameters(placement, "gateway", common, {"n1": "server"}) == {
        "constraint": "cpu", "exclusive": True, "exclude": "gpu[1-8]"}  # no spread: taken nodes do not matter
    assert placement_parameters(placement, "inference", {}, {}) == {}


def test_spread_excludes_the_nodes_of_the_other_kinds_only() -> None:
    spread = PlacementSettings(spread=True, gateway={"exclude": "gpu1"})
    taken = {"n1": "server", "n3": "inference", "n2": "gateway"}
    assert placement_parameters(spread, "gateway", {}, taken) == {"exclude": "gpu1,n1,n3"}
    assert placement_parameters(spread, "inference", {}, {"n1": "server"}) == {"exclude": "n1"}
    assert placement_parameters(spread, "server", {}, {}) == {}


def test_job_kinds_come_from_the_launchers_job_names() -> None:
    assert [job_kind(n) for n in ("polar-server", "polar-inference-1", "polar-gateway-12")] == [
        "server", "inference", "gateway"]
    assert job_kind("polar-test") is None
    spread = PlacementSettings(spread=True, gateway={"exclude": "n9"})
    assert placement_parameters(spread, None, {"qos": "high"}, {"n1": "server"}) == {"qos": "high"}
    assert placement_parameters(spread, "gateway", {}, {"n1": None, "n2": "server"}) == {"exclude": "n9,n2"}


def test_placement_reaches_the_sbatch_options_and_spread_follows_the_nodes_jobs_ran_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # submitit's Slurm executor wants an srun on PATH when it is made (it never runs it here): a machine whose Slurm
    # is not installed yet (the real-Slurm tier installs it later in the run) gets a stand-in
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")
    launcher = _launcher("launcher.placement.spread=true", "+launcher.placement.gateway.cpus_per_task=1",
                         "+launcher.additional_parameters.constraint=cpu")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = build_job(compose("config", overrides=["launcher=slurm", f"out_dir={tmp_path}"]))
    launcher.names.update({"7": "polar-server", "8": "polar-inference-0"})
    launcher.nodes.update({"7": "node1", "8": "node3"})
    params = launcher._executor(job, "polar-gateway")._executor.parameters
    assert params["additional_parameters"] == {"constraint": "cpu", "cpus_per_task": 1, "exclude": "node1,node3"}
    assert launcher._executor(job, "polar-inference")._executor.parameters["additional_parameters"] == {
        "constraint": "cpu", "exclude": "node1"}


def test_running_nodes_is_empty_without_squeue(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert running_nodes(["1", "2"]) == {} and running_nodes([]) == {}


def test_the_controllers_address_comes_from_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf 'SlurmctldAddr = (null)\\nSlurmctldHost[0]        = polar-ctl(10.77.0.1)\\n"
                        "SlurmctldPort           = 7017\\n'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert controller_address() == ("10.77.0.1", 7017)
    scontrol.write_text("#!/bin/sh\nprintf 'SlurmctldHost[0] = head01\\n'\n")
    assert controller_address() == ("head01", 6817)
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    assert controller_address() is None


def test_a_loopback_fqdn_gives_way_to_the_address_toward_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    assert launcher_host(("127.0.0.1", 6817)) == "127.0.0.1"  # a one-node cluster: loopback is right
    toward = route_address("192.0.2.1", 6817)  # TEST-NET-1: the default route's source address, if there is one
    assert launcher_host(("192.0.2.1", 6817)) == (toward or "localhost")
    monkeypatch.setattr(socket, "getfqdn", lambda: "head01.example")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.1.2.3")
    assert launcher_host(("192.0.2.1", 6817)) == "head01.example"


def test_advertised_hosts_are_each_nodes_name_or_a_pattern_of_it() -> None:
    assert advertised_host(None, "node7") == "node7"
    assert advertised_host("{host}-ib", "node7") == "node7-ib"
    assert advertised_host("10.0.0.1", "node7") == "10.0.0.1"  # fixed: one node only
    assert advertised_host(None) == socket.gethostname()
    launcher = _launcher("launcher.advertise_host='{host}-ib'", "launcher.server_host='{host}.cluster'")
    assert (launcher.advertise_host, launcher.server_host) == ("{host}-ib", "{host}.cluster")


_BACKGROUND_LOCAL_JOB = """
import os, signal, sys, time
import submitit
from polar_gym.launch.submitit_launcher import _ENDED, _state, cancel_job

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as bash starts a background job: its children inherit the ignore
executor = submitit.AutoExecutor(folder=sys.argv[1], cluster="local")
executor.update_parameters(timeout_min=10)  # submitit's own time-out signal must not end the job first
job = executor.submit(time.sleep, 600)
ignored = int(open(f"/proc/{job.job_id}/status").read().split("SigIgn:")[1].split()[0], 16)
print("controller ignores SIGINT:", bool(ignored & 1 << (signal.SIGINT - 1)), flush=True)
cancel_job(job, "local")
deadline = time.monotonic() + 120
while _state(job) not in _ENDED and time.monotonic() < deadline:
    time.sleep(0.2)
print("state after cancel:", _state(job), flush=True)
if _state(job) == "RUNNING":
    os.kill(int(job.job_id), signal.SIGKILL)
"""


def test_a_local_job_started_by_a_background_launcher_still_ends_on_cancel(tmp_path: Path) -> None:
    """submitit's local cancel is SIGINT, which a background launcher's controllers ignore; ours is SIGTERM."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BACKGROUND_LOCAL_JOB, str(tmp_path / "%j")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "controller ignores SIGINT: True" in out.stdout  # the case that hung the launch for the whole timeout
    assert "state after cancel: RUNNING" not in out.stdout and "state after cancel:" in out.stdout, out.stdout


@pytest.mark.parametrize(("state", "queued", "listed"), [
    ("RUNNING", True, True), ("CANCELLED by 0", True, True),  # COMPLETING: its processes still run
    ("RUNNING", False, False),  # squeue has let it go: sacct's word (or submitit's stale cache) is late
    ("CANCELLED by 0", None, False), ("RUNNING", None, True), (None, None, True),
])
def test_a_cancelled_job_is_gone_once_squeue_lets_it_go(state: str | None, queued: bool | None, listed: bool) -> None:
    from polar_gym.launch.submitit_launcher import _listed

    assert _listed(state, queued) is listed
