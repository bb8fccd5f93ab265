"""Issue 11, fault 3 (options.cli half): a session request cannot make the gateway host run a command or bind a host
path it names. Runtime options that reach the host's command line or file system (docker ``cli``/``run_args``, the
local ``bwrap``/``ro_binds``, the apptainer ``binary``/``binds``...) come only from the gateway's start-up
configuration; through the real HTTP API a request naming one ends in ERROR with a reason that names it, and
nothing ran. Also fault 1 through the gateway: a session's own command cannot remount and write the host."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.schema import PrepareAction
from tests.gateway._gateway_kit import LiveGateway, MakeGateway


async def _submit(gw: LiveGateway, runtime: dict[str, Any], session_id: str) -> dict[str, Any]:
    body = gw.spec(session_id).model_dump(mode="json")
    body["runtime"].update(runtime)
    admin = {"x-admin-token": gw.admin}
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        created = await client.post("/sessions", json=body, headers=admin)
        assert created.status_code in (201, 400, 422), created.text
        if created.status_code != 201:  # refused at intake: just as good, and says why
            return {"status": "REFUSED", "reason": created.text}
        done = await client.get(f"/sessions/{session_id}/result", params={"wait": 50}, headers=admin)
        assert done.status_code == 200, done.text
        return dict(done.json())


@pytest.mark.parametrize(("backend", "key", "value"), [
    ("docker", "cli", ["sh", "-c", "id > {proof}"]),
    ("docker", "run_args", ["-v", "/:/host"]),
    ("local", "bwrap", "/bin/sh"),
    ("local", "ro_binds", {"/root": "/root"}),
    ("apptainer", "binary", "{proof}.sh"),
    ("apptainer", "binds", ["/:/host"]),
])
async def test_fault3_a_request_cannot_name_host_command_lines(make_gateway: MakeGateway, tmp_path: Path,
                                                               backend: str, key: str, value: Any) -> None:
    proof = tmp_path / "proof"
    (tmp_path / "proof.sh").write_text(f"#!/bin/sh\nid > {proof}\n")
    (tmp_path / "proof.sh").chmod(0o755)
    value = [v.format(proof=proof) for v in value] if isinstance(value, list) else (
        value.format(proof=proof) if isinstance(value, str) else value)
    gw = await make_gateway()
    result = await _submit(gw, {"backend": backend, "image": "img", "options": {key: value}}, f"opt-{backend}-{key}")
    assert result["status"] in ("ERROR", "REFUSED"), result
    assert repr(key) in result["reason"] and "start-up configuration" in result["reason"], result["reason"]
    assert not proof.exists()


async def test_expose_needs_a_root_from_the_gateways_configuration(make_gateway: MakeGateway, tmp_path: Path
                                                                   ) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "input.txt").write_text("x")
    closed = await make_gateway()
    refused = await _submit(closed, {"options": {"expose": [str(data)]}}, "expose-closed")
    assert refused["status"] == "ERROR" and "expose_roots" in refused["reason"], refused
    opened = await make_gateway(expose_roots=[data])
    allowed = await _submit(opened, {"options": {"expose": [str(data)]}}, "expose-open")
    assert allowed["status"] == "COMPLETED", allowed.get("reason")


async def test_a_prepare_upload_reads_host_files_only_under_the_gateways_roots(make_gateway: MakeGateway,
                                                                             tmp_path: Path) -> None:
    """``upload_file``/``upload_dir`` with a host ``src`` would copy any file the gateway reads (/etc/shadow, the
    run's tokens) into the sandbox: only paths under ``expose_roots`` may be named."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "hints.md").write_text("hint")
    steal = PrepareAction(type="upload_file", src="/etc/shadow", dst="/workspace/loot")
    gw = await make_gateway(expose_roots=[data])
    refused = (await gw.node.run([gw.spec("steal", prepare=[steal])]))[0]
    assert refused.status.value == "ERROR" and "expose_roots" in (refused.reason or ""), refused.reason
    assert not list(gw.workdir.rglob("loot"))
    fine = PrepareAction(type="upload_file", src=str(data / "hints.md"), dst="/workspace/HINTS.md")
    allowed = (await gw.node.run([gw.spec("hints", prepare=[fine])]))[0]
    assert allowed.status.value == "COMPLETED", allowed.reason
    # under a root, read as a task's files are (issue 35): no link out of the root, no FIFO opened
    (data / "shadow").symlink_to("/etc/shadow")
    os.mkfifo(data / "pipe")
    for name, problem in (("shadow", "leaves"), ("pipe", "FIFO")):
        sneak = PrepareAction(type="upload_file", src=str(data / name), dst="/workspace/loot")
        refused = (await gw.node.run([gw.spec(f"sneak-{name}", prepare=[sneak])]))[0]
        assert refused.status.value == "ERROR" and problem in (refused.reason or ""), refused.reason
    assert not list(gw.workdir.rglob("loot"))


async def test_fault1_a_sessions_command_cannot_write_the_host(make_gateway: MakeGateway) -> None:
    target = f"/var/tmp/polar-gw-fault1-{uuid.uuid4().hex[:10]}"
    gw = await make_gateway()
    attack = PrepareAction(type="exec", command=f"mount -o remount,bind,rw /var && echo x > {target}")
    try:
        result = (await gw.node.run([gw.spec("remount", prepare=[attack])]))[0]
        assert result.status.value == "ERROR" and "prepare action 0" in (result.reason or ""), result.reason
        assert not _remove(target), f"the session wrote {target} on the host"
    finally:
        _remove(target)


def _remove(path: str) -> bool:
    """Remove ``path``; whether it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
