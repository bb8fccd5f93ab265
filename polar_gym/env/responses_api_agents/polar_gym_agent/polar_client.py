"""The polar_gym agent's I/O toward Polar, kept out of app.py so polar_gym's own tests can drive it with fakes:
an HTTP client of the rollout server (submit, long-poll the session's NeMo items, cancel, register backends), the
``polar_task`` → TaskRequest conversion through polar_gym's interpreter, and the ``python -m polar_gym.env serve``
child the agent starts when no server is configured. httpx + standard library only (NeMo Gym's venv has both)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["PolarClient", "PolarError", "ServeProcess", "polar_env", "to_task_requests"]


class PolarError(RuntimeError):
    """Polar could not run the row (bad task, server refused, no result in time); the message says which."""


class PolarClient:
    """Rollout server API calls the agent makes (admin token in ``x-admin-token``)."""

    def __init__(self, url: str, token: str, client: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        # idle connections go after 2 s, before the server's 5 s keep-alive closes them under a call (ReadError);
        # polar_gym.keepalive's value, stated here as this module runs in NeMo Gym's interpreter
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0),
                                                  limits=httpx.Limits(keepalive_expiry=2.0))
        self.headers = {"x-admin-token": token}

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self.client.request(method, self.url + path, headers=self.headers, **kwargs)
        if response.status_code >= 400:
            raise PolarError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response

    async def register_backends(self, urls: list[str]) -> list[dict[str, Any]]:
        """POST /backends for each URL: fleet-wide upstreams of every gateway's proxy (and later gateways)."""
        return [(await self._call("POST", "/backends", json={"url": url})).json() for url in urls]

    async def submit(self, task_request: dict[str, Any]) -> str:
        """POST /tasks with one sample; the session id."""
        view = (await self._call("POST", "/tasks", json=task_request)).json()
        sessions = list(view.get("sessions") or {})
        if len(sessions) != 1:
            raise PolarError(f"task {task_request.get('task_id')}: expected one session, got {sessions}")
        return str(sessions[0])

    async def nemo(self, session_id: str, timeout: float, poll: float = 30.0) -> dict[str, Any]:
        """The session's /nemo payload, long-polling until it is finished or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PolarError(f"session {session_id}: no result within {timeout:.0f}s")
            response = await self._call("GET", f"/sessions/{session_id}/nemo", params={"wait": min(poll, left)},
                                        timeout=min(poll, left) + 30.0)
            if response.status_code == 200:
                payload: dict[str, Any] = response.json()
                return payload

    async def cancel(self, session_id: str) -> None:
        await self._call("POST", f"/sessions/{session_id}/cancel")

    async def aclose(self) -> None:
        await self.client.aclose()


def polar_env(python: str) -> dict[str, str]:
    """Environment for a polar_gym child: NeMo Gym's own (its venv, PYTHONPATH, the whole config in
    NEMO_GYM_CONFIG_DICT) removed, polar's interpreter directory first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("NEMO_GYM_")}
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "/usr/bin:/bin")])
    return env


async def to_task_requests(python: str, polar_tasks: list[dict[str, Any]],
                           template: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``python -m polar_gym.env request`` over the rows: TaskRequest dicts in order (PolarError on a bad row)."""
    argv = [python, "-m", "polar_gym.env", "request"]
    if template:
        argv += ["--template", json.dumps(template)]
    proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, env=polar_env(python))
    stdin = "".join(json.dumps(t) + "\n" for t in polar_tasks).encode()
    out, err = await proc.communicate(stdin)
    if proc.returncode != 0:
        raise PolarError(f"{python} -m polar_gym.env request failed ({proc.returncode}): {err.decode()[-2000:]}")
    results = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    for task, result in zip(polar_tasks, results, strict=True):
        if "error" in result:
            raise PolarError(f"polar_task {json.dumps(task)[:200]}: {result['error']}")
    return results


class ServeProcess:
    """``<python> -m polar_gym.env serve`` as a child: started on demand, stopped with SIGTERM (SIGKILL after
    ``grace``); it also exits by itself when this process dies (``--parent-pid``)."""

    def __init__(self, python: str, args: list[str] | None = None, directory: str | None = None) -> None:
        self.python, self.args = python, list(args or [])
        self.owns_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="polar_gym_agent_"))
        self.info_file = self.dir / "serve.json"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> tuple[str, str]:
        """Start the child and wait for its info file; (url, admin token)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [self.python, "-m", "polar_gym.env", "serve", "--out-dir", str(self.dir / "serve"),
                "--info-file", str(self.info_file), "--parent-pid", str(os.getpid()), *self.args]
        with open(self.dir / "serve.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=polar_env(self.python))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.info_file.exists():
                info = json.loads(self.info_file.read_text())
                return str(info["url"]), str(info["admin_token"])
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        log_tail = (self.dir / "serve.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise PolarError(f"`{' '.join(argv)}` did not come up (exit {self.proc.returncode}); log:\n{log_tail}")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
