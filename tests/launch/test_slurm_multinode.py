"""A real 3-node Slurm on one machine (``scripts/slurm_local.sh start --nodes 3``): each node is a slurmd in network,
UTS, mount and time namespaces of its own, so a job on one node reaches another only by its name, and
``launcher=slurm`` runs the rollout server, a vLLM CPU inference job and a gateway on three different nodes.

The cluster has a state dir, ports, names and a subnet of its own, so it runs beside the one-node cluster of
test_slurm_real.py; with SLURM_LOCAL_DIR set, the environment's SLURM_LOCAL_* (and the script's defaults) say
instead. Skips without root or ``ip netns``; with CI set, a cluster that cannot start fails the test instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_gym.assets import TINY_MODEL_NAME, tiny_model_dir, tokenizer_dir, vllm_python
from polar_gym.server.postgres_local import PrivatePostgres
from polar_gym.tasks import demo_task
from tests._procs import take_ctrl_c
from tests._waiting import until_sync

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
NODES = 3
#: this tier's own cluster (the CI one-node cluster uses /tmp/polar-slurm and ports 6817-6819, 3307)
CLUSTER = {"SLURM_LOCAL_DIR": "/tmp/polar-slurm-3node", "SLURM_LOCAL_DB_PORT": "3327",
           "SLURM_LOCAL_DBD_PORT": "6829", "SLURM_LOCAL_CTLD_PORT": "6827", "SLURM_LOCAL_SLURMD_PORT": "6828",
           "SLURM_LOCAL_NAME": "pg3n", "SLURM_LOCAL_SUBNET": "10.78.0", "SLURM_LOCAL_NODE_TIMEOUT": "10"}


def _cluster_env() -> dict[str, str]:
    if "SLURM_LOCAL_DIR" in os.environ:
        return {"SLURM_LOCAL_NAME": "polar", **os.environ}  # the script's default name
    return {**os.environ, **CLUSTER}


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root: network namespaces, a bridge and slurmd"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """Start the 3-node cluster for the module; the environment to submit with (SLURM_CONF); stop it afterwards."""
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    env = _cluster_env()
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "start", "--nodes", str(NODES)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 or "export SLURM_CONF=" not in proc.stdout:
        reason = f"the {NODES}-node Slurm could not start: {proc.stderr.strip()[-2000:]}"
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    conf = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    print(f"{NODES}-node Slurm up in {time.monotonic() - started:.1f} s", file=sys.stderr)
    try:
        yield {**env, "SLURM_CONF": conf}
    finally:
        stopped = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        name = env["SLURM_LOCAL_NAME"]
        assert not [ns for ns in _netns() if ns.startswith(f"{name}-node")], "stop left a node's namespace"
        assert f"slurm_local {name} " not in Path("/etc/hosts").read_text(), "stop left the /etc/hosts block"


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _nodes(env: dict[str, str]) -> list[str]:
    return [f"{env['SLURM_LOCAL_NAME']}-node{i}" for i in range(1, NODES + 1)]


def _sbatch(env: dict[str, str], cwd: Path, node: str, command: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--cpus-per-task=1", "--mem=256M",
                          f"--output={cwd}/%j.out", "--wrap", command], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.strip().split(";")[0]


def _queued(env: dict[str, str], job_ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)], env=env, capture_output=True,
                         text=True, timeout=30)
    return [line for line in out.stdout.split() if line.strip()]


def _sacct(env: dict[str, str], job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Job id -> (state's first word, NodeList)."""
    out = subprocess.run(["sacct", "-j", ",".join(job_ids), "-X", "-n", "--parsable2", "-o", "JobID,State,NodeList"],
                         env=env, capture_output=True, text=True, timeout=30)
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2]
    return {job: (state.split()[0] if state.strip() else "", nodes) for job, state, nodes in rows}


def test_sinfo_lists_the_nodes_idle_under_their_own_names(cluster: dict[str, str]) -> None:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=cluster, capture_output=True, text=True,
                         check=True, timeout=30).stdout
    assert sorted(set(out.splitlines())) == [f"{node} idle" for node in _nodes(cluster)]


# a TCP server on one node: accepts one connection, sends its hostname, prints who connected
SERVER = """
import os, pathlib, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 0)); s.listen()
pathlib.Path(sys.argv[1] + ".tmp").write_text(str(s.getsockname()[1])); os.rename(sys.argv[1] + ".tmp", sys.argv[1])
s.settimeout(120); c, peer = s.accept(); c.sendall(socket.gethostname().encode()); print("peer", peer[0])
"""
# a client on another node: the server's port on its own loopback, then by the server node's name
CLIENT = """
import socket, sys
port = int(open(sys.argv[1]).read())
with socket.socket() as s:
    print("loopback", s.connect_ex(("127.0.0.1", port)))
print("by-name", socket.create_connection((sys.argv[2], port), timeout=10).recv(100).decode())
"""


def test_a_job_reaches_another_node_by_its_name_and_not_on_loopback(cluster: dict[str, str],
                                                                    tmp_path: Path) -> None:
    """Each node has its own network and hostname: the server job's port is not on the client node's 127.0.0.1,
    the client gets there through the server node's name, and the server sees the client node's address. Each
    node's scratch ($SLURM_LOCAL_DIR/scratch) holds only that node's files."""
    first, second, _ = _nodes(cluster)
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "client.py").write_text(CLIENT)
    port_file, scratch = tmp_path / "port", Path(cluster["SLURM_LOCAL_DIR"]) / "scratch"
    py = sys.executable
    server = _sbatch(cluster, tmp_path, second, f"hostname; touch {scratch}/mark-{second}; ls {scratch}; "
                                                f"{py} server.py {port_file}")
    until_sync(port_file.exists, 120, "the server job to listen")
    client = _sbatch(cluster, tmp_path, first, f"hostname; ls {scratch}; {py} client.py {port_file} {second}")
    until_sync(lambda: not _queued(cluster, [server, client]), 120, "both jobs to finish")
    server_out = (tmp_path / f"{server}.out").read_text().splitlines()
    client_out = (tmp_path / f"{client}.out").read_text().splitlines()
    assert server_out[0] == second and client_out[0] == first
    assert "loopback 111" in client_out, client_out  # ECONNREFUSED: nothing of node B on node A's 127.0.0.1
    assert f"by-name {second}" in client_out, client_out
    first_address = socket.gethostbyname(first)
    assert f"peer {first_address}" in server_out and not first_address.startswith("127."), server_out
    assert f"mark-{second}" in server_out and f"mark-{second}" not in client_out  # node-local scratch
    assert not list(scratch.glob("mark-*")), "a node's scratch showed through on the host"
    until_sync(lambda: {s for s, _ in _sacct(cluster, [server, client]).values()} == {"COMPLETED"}, 60,
               "sacct to record both jobs COMPLETED")


# -- launcher=slurm across the nodes ---------------------------------------------------------------------------------

LAUNCH = ["launcher=slurm", "launcher.progress=false", "launcher.gateway.cpus_per_task=1", "launcher.gateway.mem_gb=1",
          "launcher.gateway.run_slots=2", "launcher.heartbeat_seconds=1", "launcher.register_timeout_seconds=240"]


def _launch(env: dict[str, str], out: Path, *overrides: str, timeout: float) -> tuple[int, str]:
    """Run a launch to its end (Ctrl-C after ``timeout``, so it still cancels its jobs); its exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "polar_gym.launch", *LAUNCH, *overrides, f"out_dir={out}"],
                            cwd=ROOT, env={**env, "COLUMNS": "160"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=take_ctrl_c)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=180)
        finally:
            proc.kill()
        raise
    return proc.returncode, stderr


def _jobs(out: Path) -> dict[str, dict[str, str]]:
    return {j["name"]: j for j in json.loads((out / "jobs.json").read_text())}


def _results(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _all_cancelled(env: dict[str, str], jobs: dict[str, dict[str, str]]) -> dict[str, tuple[str, str]]:
    ids = [j["job_id"] for j in jobs.values()]
    until_sync(lambda: not _queued(env, ids) and {s for s, _ in _sacct(env, ids).values()} == {"CANCELLED"}, 90,
               "every job of the launch to be cancelled and recorded")
    return _sacct(env, ids)


def test_server_inference_and_gateway_run_on_three_nodes(cluster: dict[str, str], tmp_path: Path) -> None:
    """server=job, a tiny vLLM CPU inference job and a gateway job with placement.spread: three nodes, each part
    reached by its node's name; pi runs in the gateway node's sandbox; results and traces come back over HTTP. The
    launcher's inference job is tested here only: it starts, announces its URL, and the traces' tokens come from it."""
    if os.environ.get("POLAR_SKIP_ENGINE") == "1":
        pytest.skip("POLAR_SKIP_ENGINE=1: the real vLLM engine tier is skipped on purpose")
    if not vllm_python().exists() or not (tiny_model_dir() / ".complete").exists():
        pytest.fail("vLLM's CPU venv or the tiny model is missing: run `bash scripts/setup.sh --engine`")
    out = tmp_path / "run"
    code, stderr = _launch(cluster, out, "launcher.server=job", "launcher.placement.spread=true", "inference=vllm",
                           "inference.upstreams=[]", f"inference.upstream_model={TINY_MODEL_NAME}",
                           "inference.max_tokens_cap=24", "launcher.inference_jobs.count=1",
                           "launcher.inference_jobs.kind=tiny_vllm", "launcher.inference_jobs.gpus_per_node=0",
                           "launcher.inference_jobs.cpus_per_task=2", "launcher.inference_jobs.mem_gb=6",
                           "launcher.inference_jobs.ready_timeout_seconds=600", "num_samples=2",
                           "tasks.ids=[demo-calc-add]", "timeout_seconds=300", timeout=1200)
    assert code in (0, 1), stderr[-4000:]  # the tiny random model may fail the task; every session must finish
    jobs = _jobs(out)
    assert sorted(jobs) == ["polar-gateway-0", "polar-inference-0", "polar-server"]
    placed = {name: j["node"] for name, j in jobs.items()}
    assert set(placed.values()) == set(_nodes(cluster)), placed  # three kinds, three nodes
    # what the parts advertise is their node's name, never loopback
    server_url = json.loads((out / "server-job.json").read_text())["url"]
    inference_url = json.loads((out / "inference-0.json").read_text())["url"]
    assert server_url.startswith(f"http://{placed['polar-server']}:")
    assert inference_url.startswith(f"http://{placed['polar-inference-0']}:")
    with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
        gateway_urls = [url for (url,) in db.execute("SELECT url FROM gateways")]
    assert [u.rsplit(":", 1)[0] for u in gateway_urls] == [f"http://{placed['polar-gateway-0']}"]
    results = _results(out)
    assert len(results) == 2 and all(r["status"] == "COMPLETED" for r in results), results
    assert all(isinstance(r["evaluation"]["reward"], float) for r in results)  # type: ignore[index]
    traces = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert traces and all(t["metadata"]["engine"] == "vllm" and t["response_ids"]
                          and len(t["response_logprobs"]) == len(t["response_ids"]) for t in traces)
    accounted = _all_cancelled(cluster, jobs)
    assert {jobs[name]["job_id"]: node for name, node in placed.items()} == {
        job: nodes for job, (_, nodes) in accounted.items()}  # jobs.json agrees with sacct's NodeList


def test_a_gateway_on_a_node_reaches_the_launchers_own_server(cluster: dict[str, str], tmp_path: Path) -> None:
    """server=local: the gateway job, pinned to a node with launcher.placement.gateway, reaches the rollout server
    in the launcher's process on the host (whose FQDN is loopback here) and runs pi on the oracle to reward 1.0."""
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")
    out, node = tmp_path / "run", _nodes(cluster)[1]
    code, stderr = _launch(cluster, out, f"+launcher.placement.gateway.nodelist={node}", "num_samples=1",
                           "tasks.ids=[demo-calc-add,demo-slugify]", timeout=600)
    assert code == 0, stderr[-4000:]
    jobs = _jobs(out)
    assert [(name, j["node"]) for name, j in jobs.items()] == [("polar-gateway-0", node)]
    server_url = json.loads((out / "server.json").read_text())["url"]
    assert "localhost" not in server_url and "127.0.0.1" not in server_url, server_url
    results = _results(out)
    assert len(results) == 2 and all(r["status"] == "COMPLETED" and r["evaluation"]["reward"] == 1.0  # type: ignore[index]
                                     for r in results), results
    _all_cancelled(cluster, jobs)


# -- a node fails --------------------------------------------------------------------------------------------------


def _store_rows(out: Path, sql: str) -> list[tuple[object, ...]]:
    """Rows of the run's rollout store: SQLite (one server worker) or the workers' private PostgreSQL; none while
    it is not made yet, or busy for a moment."""
    if (out / "postgres" / "run").exists():
        import psycopg

        try:
            with psycopg.connect(PrivatePostgres(out / "postgres").url, connect_timeout=10) as db:
                return [tuple(row) for row in db.execute(sql).fetchall()]
        except psycopg.Error:  # not started, or its tables not made yet
            return []
    if not (out / "server.sqlite").exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{out / 'server.sqlite'}?mode=ro", uri=True, timeout=10)) as db:
            return db.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def _in_flight(out: Path) -> set[str]:
    """The gateways (ids) the server has a RUNNING session on."""
    return {str(g) for (g,) in _store_rows(out, "SELECT gateway_id FROM sessions WHERE status = 'RUNNING'")}


def test_a_node_dying_mid_run_loses_no_session(cluster: dict[str, str], tmp_path: Path) -> None:
    """The node failure the issue asks for, on the 3-node cluster: two gateway jobs on two nodes (exclusive), a
    session in flight on each; one node is killed (its slurmd and every process in its namespaces:
    ``slurm_local.sh kill-node``, a crash: nothing of the node is left and its gateway stops answering). The rollout
    server re-dispatches that node's sessions; the launcher reports the job (lost, then requeued by Slurm onto the
    free third node); ``slurm_local.sh start`` brings the node back idle; the run completes with every session once,
    none from an attempt of the dead node. The gateways work on node-local scratch. Two server workers (on the run's
    private PostgreSQL) give each gateway its own worker, so the dead node's sessions move across workers; one
    worker on SQLite losing a gateway is tests/launch/test_slurm_node_failure.py's case, on one node."""
    workers = 2
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")
    samples, out = 3, tmp_path / "run"  # one in flight on each gateway and one queued: a session takes 10 s or more
    script = tmp_path / "slow.json"  # every session runs a while, so each node has one in flight when it dies
    solution = demo_task("demo-calc-add").oracle_script()  # then solves the task, for a reward of 1
    script.write_text(solution.model_copy(update={"commands": ["sleep 10", *solution.commands]}).model_dump_json())
    scratch = Path(cluster["SLURM_LOCAL_DIR"]) / "scratch"  # each node's own directory at this path
    proc = subprocess.Popen([sys.executable, "-m", "polar_gym.launch", *LAUNCH, "launcher.gateways=2",
                             "launcher.gateway.run_slots=1", "+launcher.placement.gateway.exclusive=true",
                             "launcher.job_check_seconds=1", f"num_samples={samples}", "tasks.ids=[demo-calc-add]",
                             f"launcher.server_workers={workers}",
                             f"inference.oracle_script={script}",
                             f"launcher.gateway.workdir='{scratch}/gw-{{index}}-{{job_id}}'", f"out_dir={out}"],
                            cwd=ROOT, env={**cluster, "COLUMNS": "160"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=take_ctrl_c)
    try:
        until_sync(lambda: proc.poll() is not None or len(_in_flight(out)) == 2, 300,
                   "a session in flight on each gateway", interval=0.5)  # each poll forks a PostgreSQL backend
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        jobs = _jobs(out)
        gateway_nodes = {name: j["node"] for name, j in jobs.items()}
        assert len(set(gateway_nodes.values())) == 2, gateway_nodes  # exclusive: one gateway per node
        dead_node = gateway_nodes["polar-gateway-0"]
        node_scratch = Path(cluster["SLURM_LOCAL_DIR"]) / "nodes" / dead_node / "scratch"

        def attempts_of_unfinished() -> set[str]:
            """The attempts the node holds of sessions not finished (a finished one's dir may stay there)."""
            unfinished = {str(s) for (s,) in _store_rows(out, "SELECT session_id FROM sessions WHERE finished IS NULL")}
            return {a.name for a in node_scratch.glob("gw-*/demo-*/*") if a.is_dir() and a.parent.name in unfinished}

        # RUNNING in the store means dispatched: on a loaded machine the node may not have started the attempt yet
        until_sync(lambda: bool(attempts_of_unfinished()), 120, f"an attempt started on {dead_node}'s scratch",
                   interval=0.2)
        (dead_url,), = until_sync(lambda: _store_rows(out, f"SELECT url FROM gateways WHERE url LIKE '%{dead_node}:%'"),
                                  60, f"{dead_node}'s gateway in the store", interval=0.5)
        killed = subprocess.run(["bash", str(SCRIPT), "kill-node", dead_node], env=cluster, capture_output=True,
                                text=True, timeout=60)
        assert killed.returncode == 0, killed.stderr
        assert subprocess.run(["ip", "netns", "pids", dead_node], capture_output=True, text=True).stdout.split() == []
        with socket.socket() as probe:  # its gateway no longer answers by the node's name
            assert probe.connect_ex((dead_node, int(dead_url.rsplit(":", 1)[1]))) != 0
        dead_attempts = attempts_of_unfinished()  # what the node held when it died
        assert dead_attempts, f"no attempt of an unfinished session on {dead_node}'s scratch"
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=180)
            proc.kill()
        revived = subprocess.run(["bash", str(SCRIPT), "start", "--nodes", str(NODES)], env=cluster,
                                 capture_output=True, text=True, timeout=300)  # the next test wants every node
    assert proc.returncode == 0, stderr[-4000:]
    assert revived.returncode == 0 and f"starting slurmd on {dead_node}" in revived.stderr, revived.stderr[-2000:]
    test_sinfo_lists_the_nodes_idle_under_their_own_names(cluster)
    results = _results(out)
    assert len(results) == samples and len({r["session_id"] for r in results}) == samples
    assert all(r["status"] == "COMPLETED" and r["evaluation"]["reward"] == 1.0  # type: ignore[index]
               for r in results), [(r["status"], r.get("reason")) for r in results]
    stored = {str(r["metadata"]["attempt_id"]) for r in results}  # type: ignore[index]
    assert not stored & dead_attempts, "a result of the dead node's attempts was stored"
    traces = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    per_session: dict[str, int] = {}
    for t in traces:
        per_session[t["session_id"]] = per_session.get(t["session_id"], 0) + 1
    assert per_session == {str(r["session_id"]): r["traces"] for r in results}  # one attempt's traces each
    # the launcher saw the node go: the job lost (NODE_FAIL, or gone from the queue) and, Slurm's default being to
    # requeue a batch job whose node failed, back in the queue
    dead_job = _jobs(out)["polar-gateway-0"]["job_id"]
    assert f"gateway job {dead_job} (polar-gateway-0) lost: " in stderr, stderr[-4000:]
    store = PrivatePostgres(out / "postgres")
    store.start()  # the launch stopped it; its data stays in the run's folder
    try:
        dead = _store_rows(out, "SELECT COUNT(*) FROM gateways WHERE state = 'dead'")[0][0]
        owners = sorted(str(o) for (o,) in _store_rows(out, "SELECT DISTINCT owner FROM gateways"))
        attempts = {int(str(a)) for (a,) in _store_rows(out, "SELECT attempts FROM sessions")}
    finally:
        store.stop()
    assert dead >= 1, "the server never declared the dead node's gateway dead"
    assert owners == ["w1", "w2"] and max(attempts) <= 2
    assert not list((Path(cluster["SLURM_LOCAL_DIR"]) / "nodes").glob("*/scratch/gw-1-*")), \
        "the live gateway's node-local scratch was not removed at its job's end"
