"""`fastbert serve`'s address check: a port another process listens on is refused before the model loads (one line,
exit 1), for the plain server and a local Ray one; a port a stopped server left in TIME_WAIT passes."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator

import pytest

from fastbert import cli
from fastbert.cli.serve import bind_listening_socket, check_port_free, host_port, joins_a_ray_cluster
from fastbert.common.resolve import UserError


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.mark.parametrize("extra", [[], ["--ray"]], ids=["plain", "local-ray"])
def test_a_taken_port_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path, listener, extra):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # a local Ray server, whatever `ray start` ran on this machine
    port = listener.getsockname()[1]
    # a missing model directory would be the error if the model were loaded first
    code = cli.main(["serve", "--host", "127.0.0.1", "--port", str(port), "--model", "/no/such/dir", *extra])
    _, err = capsys.readouterr()
    assert code == 1
    assert err == f"fastbert: error: cannot serve on 127.0.0.1:{port}: Address already in use (another process " \
                  "listens there: stop it or pick another --port)\n"


def test_a_port_in_time_wait_passes():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's end closes first, so it is the one left in TIME_WAIT on ``port``
        assert client.recv(1) == b""
        client.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE  # the port is in TIME_WAIT indeed
    check_port_free("127.0.0.1", port)


def test_port_zero_passes_unchecked(monkeypatch):
    monkeypatch.setattr(socket.socket, "bind", refuse_with(errno.EADDRINUSE))
    check_port_free("127.0.0.1", 0)


@pytest.mark.parametrize("code, hint", [(errno.EADDRNOTAVAIL, "no network interface of this machine has that --host"),
                                        (errno.EACCES, "ports below 1024 need privileges")])
def test_errors_of_the_host_and_port_say_what_to_change(monkeypatch, code, hint):
    monkeypatch.setattr(socket.socket, "bind", refuse_with(code))
    with pytest.raises(UserError, match=f"cannot serve on 127.0.0.1:80: {os.strerror(code)} \\({hint}"):
        check_port_free("127.0.0.1", 80)


def refuse_with(code: int):
    def bind(self, address):
        raise OSError(code, os.strerror(code))
    return bind


@pytest.mark.parametrize("address, joins", [(None, False), ("", False), ("local", False), ("auto", True),
                                            ("10.0.0.1:6379", True)])
def test_only_a_running_ray_cluster_is_trusted_with_its_port(monkeypatch, tmp_path, address, joins):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no `ray start` here
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    assert joins_a_ray_cluster() is joins


@pytest.mark.parametrize("address", [None, ""])
def test_a_cluster_ray_start_left_on_this_machine_is_joined_as_ray_init_joins_it(monkeypatch, tmp_path, address):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("")  # an empty address file: no cluster either
    assert not joins_a_ray_cluster()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379\n")  # what `ray start --head` writes
    assert joins_a_ray_cluster()
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert not joins_a_ray_cluster()


def test_an_ipv6_address_is_written_in_brackets(monkeypatch):
    monkeypatch.setattr(socket.socket, "bind", refuse_with(errno.EADDRINUSE))
    with pytest.raises(UserError, match=r"^cannot serve on \[::1\]:8080: "):
        check_port_free("::1", 8080)
    assert host_port("::1", 80) == "[::1]:80" and host_port("0.0.0.0", 80) == "0.0.0.0:80"


def test_the_socket_listens_at_once_and_port_zero_gets_a_real_port():
    with bind_listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port != 0
        # nobody can take the port while the model loads, not even with SO_REUSEADDR, as uvicorn binds
        with pytest.raises(UserError, match=f"cannot serve on 127.0.0.1:{port}: Address already in use"):
            check_port_free("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # a client waits in the backlog
            pass


def test_a_bracketed_ipv6_host_and_ray_on_port_zero(capsys, monkeypatch):
    monkeypatch.setattr(socket.socket, "bind", refuse_with(errno.EADDRINUSE))
    assert cli.main(["serve", "--host", "[::1]", "--port", "8080", "--model", "/no/such/dir"]) == 1
    assert capsys.readouterr().err.startswith("fastbert: error: cannot serve on [::1]:8080: Address already in use")
    assert cli.main(["serve", "--ray", "--port", "0", "--model", "/no/such/dir"]) == 1
    assert capsys.readouterr().err == "fastbert: error: --port 0 (a free port) is for the plain server: Ray " \
                                      "Serve's proxy needs a --port\n"
