"""Round 5 (issue 35), the batch service under an adversary: a key on every call, its files its user's alone."""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.app import make_app  # noqa: E402
from timeslice_verl.batch.auth import KEY_ENV, NoKey, RequireKey, client_key, service_key  # noqa: E402
from timeslice_verl.batch.store import Store, StoreError  # noqa: E402

KEY = "k" * 24
CALLS = [("get", "/v1/files"), ("get", "/v1/files/file_x/content"), ("delete", "/v1/files/file_x"),
         ("get", "/v1/batches"), ("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel"),
         ("post", "/v1/batches"), ("get", "/timeslice/summary"), ("get", "/metrics")]


@pytest.fixture
def guarded(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    app = make_app(store, models=lambda: {"m"}, kick=lambda: None, summary=lambda: {"lines": {}}, metrics=lambda: b"",
                   max_file_bytes=4096)
    with TestClient(RequireKey(app, KEY)) as client:
        yield client
    store.close()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method, path", CALLS)
def test_every_call_without_the_key_is_401_in_openais_shape(guarded, headers, method, path):
    resp = getattr(guarded, method)(path, headers=headers)
    assert resp.status_code == 401, (method, path, resp.status_code)
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer KEY" in error["message"]


def test_with_the_key_the_calls_answer_and_health_needs_none(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert guarded.get("/v1/batches", headers=auth).status_code == 200
    assert guarded.get("/v1/batches/batch_x", headers=auth).status_code == 404  # past the key: the API's own answer
    assert guarded.get("/health").status_code == 200


def test_the_key_is_made_once_private_and_read_back_by_clients(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "state" / "batch.key"
    with pytest.raises(NoKey, match="start `timeslice-verl batch serve` once"):
        client_key(str(path))
    key, source = service_key(str(path))
    assert source == str(path) and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert service_key(str(path))[0] == key == client_key(str(path))  # not made again
    assert client_key(str(path), "given-key-given-key") == "given-key-given-key"
    monkeypatch.setenv(KEY_ENV, "from-the-env-from-the-env")
    assert service_key(str(path)) == ("from-the-env-from-the-env", KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(NoKey, match=KEY_ENV):
        service_key(str(path))


@pytest.mark.parametrize("mode, message", [(0o644, "readable by others"), (0o622, "writable by others")])
def test_a_key_file_others_can_read_or_write_is_refused(tmp_path, monkeypatch, mode, message):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "batch.key"
    path.write_text(KEY)
    path.chmod(mode)
    with pytest.raises(NoKey, match=message):
        client_key(str(path))
    with pytest.raises(ValueError, match=message):
        service_key(str(path))


def test_a_key_file_that_is_a_link_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    (tmp_path / "real").write_text(KEY)
    (tmp_path / "batch.key").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symbolic link"):
        service_key(str(tmp_path / "batch.key"))


def test_an_explicit_database_is_made_0600_in_a_0700_directory(tmp_path):
    old = os.umask(0o022)
    try:
        Store(tmp_path / "new" / "b.sqlite").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "b.sqlite").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_a_database_others_can_write_or_in_a_shared_directory_is_refused(tmp_path):
    planted = tmp_path / "b.sqlite"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    with pytest.raises(StoreError, match="timeslice.batch.db: .* is writable by others"):
        Store(planted)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StoreError, match="directory .* is writable by others"):
        Store(shared / "b.sqlite")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a file owned by another user")
def test_a_database_another_user_made_is_refused(tmp_path):
    planted = tmp_path / "b.sqlite"
    planted.write_bytes(b"")
    planted.chmod(0o600)
    os.chown(planted, 12345, 12345)
    with pytest.raises(StoreError, match="belongs to uid 12345"):
        Store(planted)
