"""Golden command lines for every operation and option combination (pure functions, no binary needed)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import polar_gym.apptainer as apptainer
from polar_gym.apptainer import commands as cmd
from polar_gym.apptainer.commands import ApptainerOptions
from polar_gym.apptainer.gateway import relay_start_argv
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.schema import RuntimeSpec

S = Path("/scratch/sess-1")


def start(spec: RuntimeSpec, opts: ApptainerOptions | None = None, **kw: object) -> list[str]:
    return cmd.instance_start_argv(spec, opts or ApptainerOptions(), S, "polar-sess-1-abcd", **kw)  # type: ignore[arg-type]


def test_start_default_is_rootless_contained_gateway_with_dir_overlay() -> None:
    assert start(RuntimeSpec(backend="apptainer", image="/img/claude.sif")) == [
        "singularity", "instance", "start", "--fakeroot", "--containall", "--no-privs", "--net", "--network",
        "none", "--overlay", "/scratch/sess-1/overlay", "--bind", "/scratch/sess-1:/polar",
        "/img/claude.sif", "polar-sess-1-abcd"]


def test_start_host_network_has_no_net_namespace() -> None:
    argv = start(RuntimeSpec(image="x.sif", network="host"))
    assert "--net" not in argv and "--network" not in argv


def test_start_none_network() -> None:
    argv = start(RuntimeSpec(image="x.sif", network="none"))
    assert argv[argv.index("--net"):argv.index("--net") + 3] == ["--net", "--network", "none"]


def test_start_gateway_binds_the_relay_read_only_under_the_session_mount() -> None:
    argv = start(RuntimeSpec(image="x.sif"), relay=Path("/cache/relay-1/relay"))
    assert argv[argv.index("/cache/relay-1/relay:/polar/.bin/relay:ro") - 1] == "--bind"


@pytest.mark.parametrize(("overlay", "expected"), [
    ("dir", ["--overlay", "/scratch/sess-1/overlay"]),
    ("image", ["--overlay", "/scratch/sess-1/overlay.img"]),
    ("tmpfs", ["--writable-tmpfs"]),
    ("none", []),
])
def test_start_overlay_modes(overlay: str, expected: list[str]) -> None:
    argv = start(RuntimeSpec(image="x.sif", network="host"), ApptainerOptions.from_options({"overlay": overlay}))
    middle = argv[6:argv.index("--bind")]
    assert middle == expected


def test_start_everything_at_once() -> None:
    spec = RuntimeSpec(image="docker://node:22-bookworm", network="none", workdir="/testbed", cpus=2.5,
                       memory_mb=4096, max_processes=512)
    opts = ApptainerOptions.from_options({
        "binary": "/opt/apptainer/bin/apptainer", "fakeroot": False, "containall": False, "no_privs": False,
        "overlay": "image",
        "binds": ["/data:/data:ro", "/models"], "workdir_bind": "/scratch/work", "nv": True, "limits": True,
        "hostname": "sandbox", "extra_start_args": ["--no-home"]})
    assert start(spec, opts) == [
        "/opt/apptainer/bin/apptainer", "instance", "start", "--net", "--network", "none",
        "--overlay", "/scratch/sess-1/overlay.img", "--bind", "/scratch/sess-1:/polar",
        "--bind", "/scratch/work:/testbed", "--bind", "/data:/data:ro", "--bind", "/models", "--nv",
        "--hostname", "sandbox", "--cpus", "2.5", "--memory", "4096M", "--pids-limit", "512", "--no-home",
        "docker://node:22-bookworm", "polar-sess-1-abcd"]


def test_limits_are_off_by_default() -> None:
    argv = start(RuntimeSpec(image="x.sif", cpus=2, memory_mb=100, max_processes=10))
    assert not {"--cpus", "--memory", "--pids-limit"} & set(argv)


def test_workdir_bind_true_and_read_only_image_use_the_session_workdir() -> None:
    with_true = start(RuntimeSpec(image="x.sif"), ApptainerOptions(workdir_bind=True))
    read_only = start(RuntimeSpec(image="x.sif"), ApptainerOptions(overlay="none"))
    for argv in (with_true, read_only):
        assert "/scratch/sess-1/workdir:/workspace" in argv


def test_start_needs_an_image() -> None:
    with pytest.raises(ValueError, match=r"RuntimeSpec\.image"):
        start(RuntimeSpec())


def test_options_reject_unknown_keys_and_bad_overlay() -> None:
    with pytest.raises(ValueError, match="unknown apptainer option"):
        ApptainerOptions.from_options({"overlay_size": 1})
    with pytest.raises(ValueError, match="overlay must be"):
        ApptainerOptions.from_options({"overlay": "ramdisk"})
    assert ApptainerOptions.from_options({"gpu": True}).gpu
    assert ApptainerOptions.from_options({"nv": True}).gpu


def test_exec_argv_with_pwd_and_pidfile_wrapper() -> None:
    assert cmd.exec_argv("singularity", "n1", ["python", "-c", "print(1)"], cwd="/workspace",
                         pidfile="/polar/.polar_gym/exec/3.pid", env_file="/tmp/polar-apptainer-x/env-1") == [
        "singularity", "exec", "--env-file", "/tmp/polar-apptainer-x/env-1", "--pwd=/workspace", "instance://n1",
        "/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', "/polar/.polar_gym/exec/3.pid", "python", "-c", "print(1)"]


def test_exec_argv_string_runs_through_sh_and_no_pwd() -> None:
    assert cmd.exec_argv("apptainer", "n1", "ls | wc -l") == [
        "apptainer", "exec", "instance://n1", "/bin/sh", "-c", "ls | wc -l"]


def test_stop_list_version_overlay_kill() -> None:
    assert cmd.instance_stop_argv("singularity", "n1", timeout=10) == [
        "singularity", "--quiet", "instance", "stop", "-t", "10", "n1"]
    assert cmd.instance_stop_argv("singularity", "n1", timeout=10, force=True) == [
        "singularity", "--quiet", "instance", "stop", "--force", "n1"]
    assert cmd.instance_list_argv("apptainer", "n1") == ["apptainer", "instance", "list", "--json", "n1"]
    assert cmd.instance_list_argv("apptainer") == ["apptainer", "instance", "list", "--json"]
    assert cmd.version_argv("apptainer") == ["apptainer", "--version"]
    assert cmd.overlay_create_argv("apptainer", Path("/s/overlay.img"), 2048) == [
        "apptainer", "overlay", "create", "--fakeroot", "--sparse", "--size", "2048", "/s/overlay.img"]
    assert cmd.kill_tree_argv("apptainer", "n1", [12, 40]) == [
        "apptainer", "exec", "instance://n1", "/bin/sh", "-c", cmd.KILL_TREE_SCRIPT, "kill-tree", "12", "40"]


def test_relay_start_argv_opens_the_gateway_port_then_returns() -> None:
    assert relay_start_argv() == ["/polar/.bin/relay", "-l", "18080", "-u", "/polar/gateway.sock", "--", "true"]


def test_the_cli_environment_is_ours_and_an_execs_goes_in_an_env_file() -> None:
    """Issue 35: no sandbox value in apptainer's own environment (APPTAINERENV_* carried them there), only the
    gateway's settings; the env file quotes every value for the shell script Apptainer reads it as."""
    host = {"PATH": "/usr/bin", "HOME": "/root", "APPTAINER_CACHEDIR": "/c", "APPTAINERENV_LEAK": "1",
            "SINGULARITYENV_OLD": "2", "LD_PRELOAD": "/x.so", "SECRET": "s"}
    assert cmd.host_environment(host) == {"PATH": "/usr/bin", "HOME": "/root", "APPTAINER_CACHEDIR": "/c",
                                          "LANG": "C.UTF-8"}
    text = cmd.env_file_text({"A": "x,y=z\nw", "B": "", "C": "it's $(id) `id`"})
    assert text == "A='x,y=z\nw'\nB=''\nC='it'\"'\"'s $(id) `id`'\n"
    assert shlex.split(text) == ["A=x,y=z\nw", "B=", "C=it's $(id) `id`"]
    for bad in ("A-B", "1A", ""):
        with pytest.raises(SandboxEnvError, match="shell names only"):
            cmd.env_file_text({bad: "v"})


def test_instance_names_are_valid_and_carry_the_session() -> None:
    assert cmd.instance_name(Path("/x/task 7/ sample#2"), "ab12") == "polar-sample-2-ab12"
    assert cmd.instance_name(Path("/x/..."), "ab12") == "polar-session-ab12"


def test_exports() -> None:
    for module in (apptainer, cmd):
        for name in module.__all__:
            assert hasattr(module, name), name


def test_fault3_a_request_cannot_name_the_binary_binds_or_weaken_containment(tmp_path: Path) -> None:
    """Options that reach the host's command line (or undo --containall / --no-privs) come from the operator only."""
    from polar_gym.apptainer.runtime import ApptainerRuntime
    from polar_gym.runtime.errors import RuntimeOptionError

    for key, value in (("binary", "/tmp/proof.sh"), ("binds", ["/:/host"]), ("extra_start_args", ["--writable"]),
                       ("workdir_bind", "/root"), ("containall", False), ("no_privs", False)):
        with pytest.raises(RuntimeOptionError, match=repr(key)):
            ApptainerRuntime(RuntimeSpec(backend="apptainer", image="x.sif", options={key: value}), tmp_path)
    allowed = ApptainerRuntime(RuntimeSpec(backend="apptainer", image="x.sif",
                                           options={"overlay": "tmpfs", "gpu": True}), tmp_path)
    assert allowed.opts.overlay == "tmpfs" and allowed.opts.gpu and allowed.opts.containall and allowed.opts.no_privs
