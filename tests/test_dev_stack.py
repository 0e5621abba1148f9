"""The dev stack exposes no unauthenticated Ray: compose binds to loopback with token auth from a
secret, and the local head's token is private from the moment it exists."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from verl_tasks.execution import local_head
from verl_tasks.execution.local_head import UnsafeStateDir

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"


@pytest.fixture
def open_umask():
    """umask 0: any private mode must come from the create call itself, not from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_token_is_0600_in_a_0700_folder_from_creation(tmp_path, open_umask):
    state = local_head.private_dir(tmp_path / "nested" / "ray-head")
    token = local_head.ensure_token(state / "auth_token")
    assert _mode(state) == 0o700
    assert _mode(token) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())


def test_existing_private_token_is_kept(tmp_path):
    state = local_head.private_dir(tmp_path / "ray-head")
    first = local_head.ensure_token(state / "auth_token").read_text()
    assert local_head.private_dir(state) == state
    assert local_head.ensure_token(state / "auth_token").read_text() == first


def test_state_folder_open_to_others_is_refused(tmp_path, open_umask):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with pytest.raises(UnsafeStateDir, match="chmod 700"):
        local_head.private_dir(shared)


def test_planted_token_file_or_link_is_refused(tmp_path, open_umask):
    state = local_head.private_dir(tmp_path / "ray-head")
    (state / "auth_token").write_text("planted")
    os.chmod(state / "auth_token", 0o644)
    with pytest.raises(UnsafeStateDir, match="delete it"):
        local_head.ensure_token(state / "auth_token")
    (state / "auth_token").unlink()
    os.symlink(tmp_path / "elsewhere", state / "auth_token")
    with pytest.raises(UnsafeStateDir, match="not a plain file"):
        local_head.ensure_token(state / "auth_token")
    assert not (tmp_path / "elsewhere").exists()


def test_cli_start_in_a_shared_folder_prints_one_line(tmp_path, open_umask, caplog):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    assert local_head.main(["start", "--state-dir", str(shared)]) == 2
    assert not (shared / "auth_token").exists()
    assert any("not a private directory" in r.getMessage() for r in caplog.records)


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_publishes_ports_on_loopback_only():
    services = _compose()["services"]
    published = {(name, str(port)) for name, svc in services.items() for port in svc.get("ports", [])}
    assert ("ray-head", "127.0.0.1:8265:8265") in published
    assert [p for p in published if not p[1].startswith("127.0.0.1:")] == []


def test_compose_ray_head_uses_token_auth_from_a_secret():
    doc = _compose()
    head = doc["services"]["ray-head"]
    assert head["environment"]["RAY_AUTH_MODE"] == "token"
    assert "ray_token" in head["secrets"]
    assert head["environment"]["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_token"
    assert "file" in doc["secrets"]["ray_token"]
    for name, svc in doc["services"].items():  # every client of the head gets the same secret
        env = svc.get("environment", {})
        assert "RAY_AUTH_TOKEN" not in env, f"{name} carries a literal Ray token"
        if name.startswith("airflow"):
            assert env["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_token" and "ray_token" in svc["secrets"]
    assert "disabled" not in COMPOSE.read_text()
    assert not re.search(r"[0-9a-fA-F]{32,}", COMPOSE.read_text()), "a literal token in compose.yaml"


def test_compose_holds_no_credential_and_gives_each_service_only_its_own(tmp_path):
    """Every credential is a secret file made by docker/make-secrets.sh; MinIO's root pair reaches only MinIO
    and the init job; the image runs as a non-root user."""
    doc = _compose()
    for name, svc in doc["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|KEY)$", key) or str(value).startswith("/run/secrets/"), \
                f"{name}: {key} is a literal credential"
            assert "airflow:airflow@" not in str(value) and "minio-secret" not in str(value), f"{name}: {key}"
    holders = {name for name, svc in doc["services"].items() if "minio_root_password" in (svc.get("secrets") or [])}
    assert holders == {"minio", "minio-init"}, holders
    assert "AWS_SHARED_CREDENTIALS_FILE" in doc["services"]["ray-head"]["environment"]
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert re.search(r"^USER verl$", dockerfile, re.M) and "bubblewrap" in dockerfile

    script = tmp_path / "make-secrets.sh"
    script.write_text((COMPOSE.parent / "make-secrets.sh").read_text())
    subprocess.run(["bash", str(script)], check=True, capture_output=True)
    made = {path.name for path in (tmp_path / "secrets").iterdir()}
    assert made == set(doc["secrets"]), made ^ set(doc["secrets"])
    assert all(_mode(path) == 0o600 for path in (tmp_path / "secrets").iterdir())
    connections = json.loads((tmp_path / "secrets" / "airflow_connections").read_text())
    assert connections["aws_default"]["password"] == (tmp_path / "secrets" / "minio_password").read_text()
