"""The plugin under the real NeMo Gym 0.7.0 (its own venv, Python 3.13): discovery, `gym env start` of the agent +
resources server (+ the declared legacy relay), and `gym eval run --no-serve` collecting demo-task rollouts through
a `polar_gym.env serve` child the agent starts (oracle engine, pi harness). Every process is stopped afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from polar_gym.journal import ATTEMPTS_DIR, read_session
from polar_gym.merge.cli import find_journals
from polar_gym.tasks import DEMO_TASKS
from tests._procs import processes_with, take_ctrl_c
from tests._vllm import VLLMServer
from tests.env._capture_kit import gym_side
from tests.env._env_kit import AGENT_DIR, ENV_DIR, gym_venv_or_skip, nemo_rl_contiguity

pytestmark = pytest.mark.slow

AGENT_CONFIG = "responses_api_agents/polar_gym_agent/configs/polar_gym_agent.yaml"
RESOURCES_CONFIG = "resources_servers/polar_gym_resources/configs/polar_gym_resources.yaml"
SERVERS = ["responses_api_agents/polar_gym_agent", "resources_servers/polar_gym_resources",
           "environment_servers/legacy_agent"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _head_port() -> int:
    """A free port for Gym's head server between Ray's worker ports (10002-19999) and the kernel's ephemeral ones
    (32768-60999), where Ray's processes, which start between this choice and the head server's bind, take theirs:
    an ephemeral port free a moment ago was taken by one of them."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    return _free_port()


def test_the_agents_own_gym_layout_tests_pass_in_gyms_interpreter() -> None:
    venv = gym_venv_or_skip()
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "unittest", "discover", "-s", "tests", "-t", ".", "-v"],
                          cwd=AGENT_DIR, env={**os.environ, "PYTHONPATH": str(AGENT_DIR)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sum(f.read_text().count("    def test_") for f in (AGENT_DIR / "tests").glob("test_*.py"))
    assert written >= 4 and f"Ran {written} tests" in proc.stderr and "OK" in proc.stderr  # every one of them ran


def test_gym_lists_the_agent(tmp_path: Path) -> None:
    gym = gym_venv_or_skip() / "bin" / "gym"
    out = subprocess.run([str(gym), "--json", "list", "agents", "--search-dir", str(ENV_DIR)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    agents = {a["name"]: a for a in json.loads(out[out.index("["):])}
    assert "polar_gym_agent" in agents and agents["polar_gym_agent"]["description"]
    assert not agents["polar_gym_agent"]["self_contained"]


class _NotUp(Exception):
    """`gym env start` did not come up (its log's end is the message)."""


@contextlib.contextmanager
def gym_started(tmp_path: Path, *overrides: str, configs: tuple[Path, ...] = ()) -> Iterator[dict]:
    """`gym env start` of the plugin in tmp_path (venvs are symlinks to the prebuilt one, a pinned head port, any
    extra Hydra ``overrides`` and agent ``configs``); yields what `gym eval run` needs; stops everything with SIGINT
    and checks nothing is left (by a marker). Started again, up to three times, on a fresh head port when a start
    does not come up: a port free a moment ago may be taken by then (Ray's processes pick ports too, see
    :func:`_head_port`)."""
    for attempt in (1, 2, 3):
        with contextlib.ExitStack() as stack:
            try:
                started = stack.enter_context(_gym_started_once(tmp_path, attempt, *overrides, configs=configs))
            except _NotUp as exc:
                if attempt == 3:
                    pytest.fail(f"gym env start did not come up:\n{exc}")
                continue
            yield started
            return


@contextlib.contextmanager
def _gym_started_once(tmp_path: Path, attempt: int, *overrides: str, configs: tuple[Path, ...] = ()
                      ) -> Iterator[dict]:
    venv = gym_venv_or_skip()
    for server in SERVERS:
        (tmp_path / "venvs" / server).mkdir(parents=True, exist_ok=True)
        if not (tmp_path / "venvs" / server / ".venv").is_symlink():
            (tmp_path / "venvs" / server / ".venv").symlink_to(venv)
    marker = f"polar-gym-env-test-{uuid.uuid4().hex}"
    env = {**os.environ, "POLAR_PYTHON": sys.executable, "POLAR_ENV_TEST_MARKER": marker}
    env.pop("VIRTUAL_ENV", None)
    port = _head_port()
    argv = [str(venv / "bin" / "gym"), "env", "start", "--search-dir", str(ENV_DIR), "--config", AGENT_CONFIG,
            "--config", RESOURCES_CONFIG, *(arg for config in configs for arg in ("--config", str(config))),
            "+skip_venv_if_present=true", f"+uv_venv_dir={tmp_path / 'venvs'}",
            f"+head_server.port={port}", *overrides]
    log = tmp_path / f"env_start-{attempt}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=take_ctrl_c)
    try:
        deadline = time.monotonic() + 120
        taken = f"error while attempting to bind on address ('127.0.0.1', {port}): address already in use"
        while "servers ready!" not in (text := log.read_text(errors="replace")):
            # the head server lost its port to another process: it never comes up, so start again now rather
            # than at the deadline (120 s lost in a heavy run)
            if proc.poll() is not None or time.monotonic() > deadline or taken in text:
                raise _NotUp(text[-4000:])
            time.sleep(0.5)
        yield {"gym": venv / "bin" / "gym", "env": env, "port": port, "cwd": tmp_path, "log": log}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        leftovers: list[str] = []
        for _ in range(100):  # Ray's and the servers' last processes may take a moment to exit
            leftovers = processes_with(marker)
            if not leftovers:
                break
            time.sleep(0.2)
        for line in leftovers:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        for ray_dir in Path("/tmp/ray").glob(f"session_*_{proc.pid}"):  # this run's Ray session files
            shutil.rmtree(ray_dir, ignore_errors=True)
        assert not leftovers, f"processes left behind: {leftovers}"



SINK_AGENT = "polar_gym_agent_sink"
REMOTE_FLEET_AGENT = "polar_gym_agent_remote"
AGENT_OVERRIDE = "++polar_gym_agent.responses_api_agents.polar_gym_agent"


def second_agent(config_dir: Path, name: str, **settings: object) -> Path:
    """A config file for a second instance of the polar_gym agent, named ``name``, with its own declared legacy relay:
    the shipped settings with ``settings`` over them (and no dataset). Two tests' agents then share one `gym env
    start` (NeMo Gym's five servers and Ray: about 20 s of CPU a start), each test's rows sent to its own agent by
    `gym eval run --agent`."""
    shipped = yaml.safe_load((ENV_DIR / AGENT_CONFIG).read_text())
    agent = shipped["polar_gym_agent"]["responses_api_agents"]["polar_gym_agent"]
    agent.pop("datasets")
    relay = shipped["polar_gym_agent_environment_server"]["environment_servers"]["legacy_agent"]
    relay["agent_server"]["name"] = name
    path = config_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        name: {"responses_api_agents": {"polar_gym_agent": {**agent, **settings}}},
        f"{name}_environment_server": {"environment_servers": {"legacy_agent": relay}}}))
    return path


@pytest.fixture(scope="module")
def gym_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One `gym env start` with two agents: the shipped one (oracle engine, a fleet of its own) and SINK_AGENT,
    which also delivers every chain through a token sink (its own fleet in ``sink_serve_dir``)."""
    root = tmp_path_factory.mktemp("gym")
    sink = second_agent(root, SINK_AGENT, deliver_tokens="token_sink", token_sink_root=str(root / "token-sink"),
                        serve_dir=str(root / "sink-serve"))
    with gym_started(root, configs=(sink,)) as started:
        yield {**started, "sink_root": root / "token-sink", "sink_serve_dir": root / "sink-serve"}


def _eval_run(gym_env: dict, rows: list[str], agent: str = "polar_gym_agent") -> list[dict]:
    cwd: Path = gym_env["cwd"]
    (cwd / f"{agent}.jsonl").write_text("\n".join(rows) + "\n")
    out = cwd / "out" / agent / "rollouts.jsonl"
    argv = [str(gym_env["gym"]), "eval", "run", "--no-serve", "--agent", agent, "--input", str(cwd / f"{agent}.jsonl"),
            "--output", str(out), f"+head_server.port={gym_env['port']}"]
    done = subprocess.run(argv, cwd=cwd, env=gym_env["env"], capture_output=True, text=True, timeout=600,
                          preexec_fn=take_ctrl_c)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(t) for t in out.read_text().splitlines() if t.strip()]


def test_eval_run_collects_demo_rollouts_through_polar(gym_env: dict) -> None:
    rows = (AGENT_DIR / "data" / "example.jsonl").read_text().splitlines()[:2]
    lines = _eval_run(gym_env, rows)
    assert sorted(line["polar_task"]["demo"] for line in lines) == sorted(json.loads(r)["polar_task"]["demo"]
                                                                          for r in rows)
    for line in lines:
        assert line["reward"] == 1.0 and not line["mask_sample"], line.get("failure_reason")
        assert line["polar"]["status"] == "COMPLETED" and line["polar"]["extra_chains"] == 0
        output = line["response"]["output"]
        trained = [item for item in output if item["type"] == "message"]
        assert trained, "no training items"
        for item in trained:
            assert item["prompt_token_ids"] and item["generation_token_ids"]
            assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
        nemo_rl_contiguity(output)
    assert "DEPRECATED" not in gym_env["log"].read_text(errors="replace")  # the relay is declared, not generated


@contextlib.contextmanager
def polar_serve(out: Path, *args: str) -> Iterator[dict]:
    """`python -m polar_gym.env serve` started by the test (standing in for a cluster's rollout server + gateways);
    yields its url and admin_token; stopped with SIGINT afterwards."""
    info = out / "polar.json"
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "polar_gym.env", "serve", "--out-dir", str(out / "fleet"),
                             "--info-file", str(info), *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=take_ctrl_c)
    try:
        deadline = time.monotonic() + 120
        while not info.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "polar_gym.env serve did not come up"
            time.sleep(0.2)
        yield json.loads(info.read_text())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert not info.exists()  # serve removes its info file when it stops


def _session_status(fleet: Path, session_id: str) -> str:
    with contextlib.closing(sqlite3.connect(fleet / "server.sqlite")) as db:
        (status,) = db.execute("SELECT status FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    return str(status)


@pytest.fixture(scope="module")
def gym_with_policy(tmp_path_factory: pytest.TempPathFactory, vllm_server: VLLMServer) -> Iterator[dict]:
    """NeMo RL's two arrangements in one `gym env start`, Gym's global ``policy_base_url`` the real vLLM CPU server
    (tiny random Qwen3, in place of NeMo RL's policy): the shipped agent starts a Polar fleet of its own (in
    ``serve_dir``) and hands it the policy; REMOTE_FLEET_AGENT submits to a fleet started before the policy existed
    (vllm engine, no upstream; ``polar``) and POSTs the policy to its /backends."""
    root = tmp_path_factory.mktemp("gym-policy")
    with polar_serve(root / "polar", "--engine", "vllm", "--prompt-mode", "token_in", "--await-upstreams",
                     "--upstream-model", vllm_server.model, "--max-tokens-cap", "24") as polar:
        remote = second_agent(root, REMOTE_FLEET_AGENT, polar_server_url=polar["url"],
                              polar_admin_token=polar["admin_token"], register_policy_backend=True,
                              session_timeout_seconds=600)
        overrides = [f"++policy_base_url={vllm_server.url}/v1", f"{AGENT_OVERRIDE}.register_policy_backend=true",
                     f"{AGENT_OVERRIDE}.serve_dir={root / 'serve'}", f"{AGENT_OVERRIDE}.session_timeout_seconds=600",
                     f"{AGENT_OVERRIDE}.serve_args=[--engine,vllm,--prompt-mode,token_in,"
                     f"--upstream-model,{vllm_server.model},--max-tokens-cap,24]"]
        with gym_started(root / "gym", *overrides, configs=(remote,)) as started:
            yield {**started, "serve_dir": root / "serve", "polar": polar, "fleet": root / "polar" / "fleet"}


def test_the_policy_server_becomes_the_gateways_upstream(gym_with_policy: dict, vllm_server: VLLMServer) -> None:
    """With register_policy_backend the agent hands Gym's policy_base_url to the Polar fleet it starts, and the
    session's tokens are sampled there."""
    row = json.dumps({"responses_create_params": {"input": "fix calc.py"}, "polar_task": {"demo": "demo-calc-add"}})
    (line,) = _eval_run(gym_with_policy, [row])
    # a random tiny model does not fix the bug: the session completes, the evaluator scores it 0 through verify
    assert line["polar"]["status"] == "COMPLETED" and line["reward"] == 0.0 and not line["mask_sample"], line["polar"]
    calls = [r for journal in find_journals([gym_with_policy["serve_dir"]]) for r in read_session(journal)]
    assert calls and {(c.engine, c.server) for c in calls} == {("vllm", vllm_server.url)}
    trained = [item for item in line["response"]["output"] if item["type"] == "message"]
    sampled = sorted((tuple(c.response_ids) for c in calls if not c.side_request), key=len)
    assert trained and sorted((tuple(i["generation_token_ids"]) for i in trained), key=len) == sampled
    nemo_rl_contiguity(line["response"]["output"])


def test_the_policy_is_registered_with_a_remote_fleet_started_without_one(gym_with_policy: dict,
                                                                           vllm_server: VLLMServer) -> None:
    """The NeMo RL arrangement: the agent is configured with a rollout server (polar_server_url: it starts no fleet
    of its own and submits there) and POSTs Gym's policy_base_url to its /backends, which every gateway's proxy then
    samples from."""
    polar, fleet = gym_with_policy["polar"], gym_with_policy["fleet"]
    row = json.dumps({"responses_create_params": {"input": "fix it"}, "polar_task": {"demo": "demo-calc-add"}})
    (line,) = _eval_run(gym_with_policy, [row], agent=REMOTE_FLEET_AGENT)
    backends = httpx.get(f"{polar['url']}/backends", headers={"x-admin-token": polar["admin_token"]}).json()
    assert backends["backends"] == [vllm_server.url]
    assert line["polar"]["status"] == "COMPLETED" and line["reward"] == 0.0  # a random model does not fix the bug
    # it ran on the configured server, not on a fleet the agent started
    assert _session_status(fleet, line["polar"]["session_id"]) == "COMPLETED"
    calls = [r for journal in find_journals([fleet]) for r in read_session(journal)]
    assert calls and {(c.engine, c.server) for c in calls} == {("vllm", vllm_server.url)}
    trained = [item for item in line["response"]["output"] if item["type"] == "message"]
    assert [i["generation_token_ids"] for i in trained] == [c.response_ids for c in calls if not c.side_request]


#: a scripted harness with a sub-agent (the shell harness runs it in the sandbox): the main agent and an explore
#: sub-agent call the gateway in turn (Chat Completions, stdlib only), then the main agent fixes calc.py
SUB_AGENT_HARNESS = '''
import json, os, urllib.request
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
def ask(conv):
    body = json.dumps({"model": os.environ["POLAR_MODEL"], "messages": conv, "tools": TOOLS}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {
        "content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    message = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]
    conv.append({k: v for k, v in message.items() if v is not None})
    for call in message.get("tool_calls") or []:
        conv.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
main = [{"role": "system", "content": "Main agent."}, {"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]
sub = [{"role": "system", "content": "Explore sub-agent."}, {"role": "user", "content": "Look around."}]
for _ in range(2):
    ask(main)
    ask(sub)
ask(main)
with open("calc.py") as fh:
    code = fh.read()
with open("calc.py", "w") as fh:
    fh.write(code.replace("a - b", "a + b"))
'''


def test_a_rollout_with_a_sub_agent_delivers_both_chains_through_the_token_sink(gym_env: dict) -> None:
    """deliver_tokens: token_sink. The session's main agent and sub-agent are two chains; the agent puts both
    through polar_gym's journal transport under NeMo Gym's rollout id, and a fresh TokenSource freezes both with
    their links, where Gym's own builder on the same snapshot delivers the main chain only."""
    sink_root, serve_dir = gym_env["sink_root"], gym_env["sink_serve_dir"]
    request = DEMO_TASKS["demo-calc-add"].to_request(harness="shell", model_name="policy").model_dump(mode="json")
    request["agent"]["config"] = {"command": "python3 agent.py", "files": {"agent.py": SUB_AGENT_HARNESS}}
    row = json.dumps({"responses_create_params": {"input": "fix it"}, "polar_task": {"task_request": request}})
    (line,) = _eval_run(gym_env, [row], agent=SINK_AGENT)
    assert line["reward"] == 1.0 and line["polar"]["status"] == "COMPLETED", line.get("failure_reason")
    metadata = line["response"]["metadata"]
    assert (metadata["polar_token_entries"], metadata["polar_token_chains"]) == ("5", "2")
    got = gym_side(gym_venv_or_skip() / "bin" / "python", sink_root, metadata["polar_token_rollout_id"])
    assert not got["incomplete"] and len(got["entries"]) == 5 and all(e["link_verified"] for e in got["entries"])
    assert got["every_chain_items"] == [3, 2] and all(got["every_chain_contiguous"])
    assert sorted(e["resolution"] for e in got["entries"]) == ["resolved"] * 3 + ["root"] * 2
    # NeMo Gym's own builder over the same snapshot: two chains found, one delivered (the /nemo payload has no call
    # times, so which one it calls main is its tie-break on call ids)
    assert got["gym_chains"] == 2 and got["gym_main_generation_items"] in (2, 3) and got["gym_delivered_fraction"] < 1
    assert sum(1 for item in line["response"]["output"] if item.get("generation_token_ids")) == 3
    # the same session read straight from the gateway's journal (a gateway session's current attempt): the same
    # calls, the same cumulative tokens, the same two chains
    (journal,) = find_journals([serve_dir])
    captures = journal.parents[2] if journal.parent.name == ATTEMPTS_DIR else journal.parent
    direct = gym_side(gym_venv_or_skip() / "bin" / "python", captures, line["polar"]["session_id"])
    assert sorted(e["digest"] for e in direct["entries"]) == sorted(e["digest"] for e in got["entries"])
    assert direct["every_chain_items"] == [3, 2] and not direct["incomplete"]
