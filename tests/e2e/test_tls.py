"""End to end: TLS on the proxy listener (SPEC "The YAML file": ``tls: {cert, key}``).

Each test makes its own certificate authority and pairs for ``localhost`` and
``127.0.0.1`` in ``tmp_path`` (``cryptography``); the clients are ``curl`` and python's
``ssl``, trusting only that authority. What is proved:

- curl gets answers over HTTP/1.1 and, by ALPN, HTTP/2; the pod sees
  ``X-Forwarded-Proto: https``;
- ALPN selects ``h2`` when the client offers it and ``http/1.1`` otherwise; the
  protocol is TLS 1.2 or newer, and a client limited to TLS 1.1 (which can speak it: it
  does with a server that allows it) fails the handshake;
- the pair is read again on reload (SIGHUP, or only the files rewritten: they are
  watched): new handshakes get the new certificate, a connection opened before keeps
  working on the old one;
- a bad pair on reload (a key that does not match, a missing file) keeps the old pair
  serving, and ``/status`` ``config.last_error`` says what is wrong;
- ``activator check`` exits 0 for a good pair and 2, naming the problem, for a bad one;
  ``activator run`` with a bad pair exits 2.

Every test that proxies ends with the pod's peak within ``container_concurrency`` and
the activator idle. No test asserts on elapsed time.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import shutil
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from harness import (
    DEFAULT_TIMEOUT,
    LOCALHOST,
    Activator,
    ActivatorFactory,
    Pod,
    PodFactory,
    curl,
    make_config,
    run_cli,
    wait_until,
    write_atomic,
)

pytestmark = pytest.mark.binary

HOSTNAME = "localhost"


class Authority:
    """A certificate authority of the test's own, and the pairs it signs for
    ``localhost`` / ``127.0.0.1``; ``ca`` is the PEM file clients trust."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "activator test authority")])
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca = directory / "ca.pem"
        self.ca.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
        )

    def issue(self, cert: Path, key: Path, common_name: str = HOSTNAME) -> int:
        """Write a new pair (a new key, a new serial) to ``cert`` and ``key``, each file
        replaced at once (written beside it, renamed over); the certificate's serial."""
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        leaf = (
            self._builder(subject, leaf_key.public_key())
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(HOSTNAME), x509.IPAddress(ipaddress.ip_address(LOCALHOST))]),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomic(key, key_pem.decode())
        write_atomic(cert, leaf.public_bytes(serialization.Encoding.PEM).decode())
        return leaf.serial_number


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    directory = tmp_path / "pki"
    directory.mkdir()
    return Authority(directory)


@pytest.fixture
def pair(tmp_path: Path, authority: Authority) -> tuple[Path, Path, int]:
    """A good pair in ``tmp_path``: (cert, key, serial)."""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    serial = authority.issue(cert, key)
    return cert, key, serial


def tls_config(pods: list[Pod], cert: Path, key: Path, **top: Any) -> dict[str, Any]:
    return make_config(pods, top={"tls": {"cert": str(cert), "key": str(key)}, **top})


def client_context(
    authority: Authority, alpn: list[str] | None = None, maximum: ssl.TLSVersion | None = None
) -> ssl.SSLContext:
    """A client trusting only ``authority``, checking the host name, offering ``alpn``."""
    context = ssl.create_default_context(cafile=str(authority.ca))
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    if maximum is not None:
        # Old protocols are off by default in OpenSSL 3: allow them, so that only the
        # server can refuse.
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        context.minimum_version = maximum
        context.maximum_version = maximum
    return context


def handshake(act: Activator, context: ssl.SSLContext) -> ssl.SSLSocket:
    """A new TLS connection to the activator's port (the caller closes it)."""
    raw = socket.create_connection((LOCALHOST, act.port), timeout=DEFAULT_TIMEOUT)
    try:
        return context.wrap_socket(raw, server_hostname=HOSTNAME)
    except BaseException:
        raw.close()
        raise


def serial_of(sock: ssl.SSLSocket) -> int:
    cert = sock.getpeercert()
    assert cert, "no peer certificate"
    return int(str(cert["serialNumber"]), 16)


def served_serial(act: Activator, authority: Authority) -> int:
    """The serial of the certificate a new handshake gets."""
    with handshake(act, client_context(authority)) as sock:
        return serial_of(sock)


def https(act: Activator, authority: Authority) -> http.client.HTTPSConnection:
    """A keep-alive HTTP/1.1 client over TLS to the activator."""
    return http.client.HTTPSConnection(
        HOSTNAME, act.port, timeout=DEFAULT_TIMEOUT, context=client_context(authority, ["http/1.1"])
    )


def echo(conn: http.client.HTTPSConnection, path: str = "/echo") -> dict[str, Any]:
    """``GET`` the backend's echo over ``conn``: what the pod received."""
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


def settle(act: Activator, pod: Pod) -> None:
    assert pod.stats()["peak"] <= 1, pod.stats()
    act.wait_idle()


@pytest.mark.parametrize(("flag", "version"), [("--http1.1", "1.1"), ("--http2", "2")])
def test_curl_over_tls(
    pod_factory: PodFactory,
    activator_factory: ActivatorFactory,
    authority: Authority,
    pair: tuple[Path, Path, int],
    tmp_path: Path,
    flag: str,
    version: str,
) -> None:
    (pod,) = pod_factory(1)
    cert, key, _ = pair
    act = activator_factory(tls_config([pod], cert, key))
    out = tmp_path / "body.json"

    result = curl(
        flag,
        "--cacert",
        str(authority.ca),
        "--resolve",
        f"{HOSTNAME}:{act.port}:{LOCALHOST}",
        "-H",
        "X-Test: over tls",
        "-o",
        str(out),
        "-w",
        "%{http_version} %{response_code}",
        f"https://{HOSTNAME}:{act.port}/echo/tls?q=1",
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{version} 200", result.stdout
    seen = json.loads(out.read_text())
    assert seen["target"] == "/echo/tls?q=1"
    assert seen["headers"]["x-forwarded-proto"] == "https"
    assert seen["headers"]["x-test"] == "over tls"
    assert seen["headers"].get("host") == f"{HOSTNAME}:{act.port}", seen["header_list"]
    settle(act, pod)


@pytest.mark.parametrize(
    ("offered", "selected"),
    [(["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1"), (None, None)],
    ids=["h2-offered", "http1-only", "no-alpn"],
)
def test_alpn_selects_h2_when_offered_and_tls_is_1_2_or_newer(
    pod_factory: PodFactory,
    activator_factory: ActivatorFactory,
    authority: Authority,
    pair: tuple[Path, Path, int],
    offered: list[str] | None,
    selected: str | None,
) -> None:
    (pod,) = pod_factory(1)
    cert, key, serial = pair
    act = activator_factory(tls_config([pod], cert, key))

    with handshake(act, client_context(authority, offered)) as sock:
        assert sock.selected_alpn_protocol() == selected
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        assert serial_of(sock) == serial
        if selected != "h2":  # HTTP/1.1 on this very connection
            sock.sendall(f"GET /echo HTTP/1.1\r\nHost: {HOSTNAME}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert json.loads(body)["headers"]["x-forwarded-proto"] == "https"
    settle(act, pod)


class Tls11Server:
    """A python ``ssl`` server on 127.0.0.1 that allows TLS 1.1: it shows that the client of
    the next test can speak TLS 1.1, so that its failure against activator is activator's."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.context.set_ciphers("DEFAULT:@SECLEVEL=0")
        self.context.minimum_version = ssl.TLSVersion.TLSv1_1
        self.listener = socket.create_server((LOCALHOST, 0))
        self.port = self.listener.getsockname()[1]
        self.versions: list[str | None] = []
        self.thread = threading.Thread(target=self._serve_one, daemon=True)
        self.thread.start()

    def _serve_one(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(DEFAULT_TIMEOUT)
        try:
            with self.context.wrap_socket(conn, server_side=True) as tls:
                self.versions.append(tls.version())
        except (OSError, ssl.SSLError):
            self.versions.append(None)
        finally:
            conn.close()
            self.listener.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ssl.TLSVersion.TLSv1_1 is deprecated: that is the point
def test_client_limited_to_tls_1_1_fails_the_handshake(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, authority: Authority, pair: tuple[Path, Path, int]
) -> None:
    (pod,) = pod_factory(1)
    cert, key, _ = pair
    act = activator_factory(tls_config([pod], cert, key))
    old_client = client_context(authority, maximum=ssl.TLSVersion.TLSv1_1)

    control = Tls11Server(cert, key)
    with (
        socket.create_connection((LOCALHOST, control.port), timeout=DEFAULT_TIMEOUT) as raw,
        old_client.wrap_socket(raw, server_hostname=HOSTNAME) as tls,
    ):
        assert tls.version() == "TLSv1.1"
    control.thread.join(DEFAULT_TIMEOUT)
    assert control.versions == ["TLSv1.1"]

    with pytest.raises(ssl.SSLError):
        handshake(act, old_client).close()

    # The listener is unharmed: a current client still gets through.
    conn = https(act, authority)
    try:
        assert echo(conn)["headers"]["x-forwarded-proto"] == "https"
    finally:
        conn.close()
    settle(act, pod)


def test_plain_http_on_the_tls_port_gets_a_400_and_a_clean_close(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, authority: Authority, pair: tuple[Path, Path, int]
) -> None:
    (pod,) = pod_factory(1)
    cert, key, _ = pair
    act = activator_factory(tls_config([pod], cert, key))
    host, port = act.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=DEFAULT_TIMEOUT) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: a.example\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):  # a reset would raise here: the close must be a clean FIN
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert b"Connection: close\r\n" in answer
    assert pod.stats()["count"] == 0
    conn = https(act, authority)  # the listener is unharmed
    try:
        assert echo(conn)["headers"]["x-forwarded-proto"] == "https"
    finally:
        conn.close()
    settle(act, pod)


@pytest.mark.parametrize("how", ["sighup", "files-watched"])
def test_new_pair_serves_new_handshakes_and_old_connections_are_renewed_gracefully(
    pod_factory: PodFactory,
    activator_factory: ActivatorFactory,
    authority: Authority,
    pair: tuple[Path, Path, int],
    how: str,
) -> None:
    (pod,) = pod_factory(1)
    cert, key, old_serial = pair
    act = activator_factory(tls_config([pod], cert, key))
    before = https(act, authority)
    busy = https(act, authority)
    try:
        echo(before)
        old_sock = before.sock
        assert isinstance(old_sock, ssl.SSLSocket) and serial_of(old_sock) == old_serial
        busy.request("GET", "/hold?key=during", headers={"Host": HOSTNAME})
        wait_until(lambda: pod.held() == ["during"], message="a request in progress at the reload")

        new_serial = authority.issue(cert, key, common_name=f"{HOSTNAME} renewed")
        assert new_serial != old_serial
        if how == "sighup":
            act.reload()
        wait_until(
            lambda: served_serial(act, authority) == new_serial,
            message=f"new handshakes to get the new certificate ({how})",
        )

        # The connections made before end gracefully, so that their clients come back to
        # the new certificate: an idle one is closed, one in progress finishes its answer.
        old_sock.settimeout(DEFAULT_TIMEOUT)
        assert old_sock.recv(1) == b"", "the idle connection was not closed"
        assert pod.release("during") == 1
        answer = busy.getresponse()
        assert (answer.status, answer.getheader("Connection")) == (200, "close")
        answer.read()
    finally:
        before.close()
        busy.close()
    act.wait_for(lambda st: st["config"]["last_error"] is None, message="the reload took")
    settle(act, pod)


@pytest.mark.parametrize("breakage", ["key-not-matching", "key-missing"])
def test_bad_pair_on_reload_keeps_the_old_one_and_says_why(
    pod_factory: PodFactory,
    activator_factory: ActivatorFactory,
    authority: Authority,
    pair: tuple[Path, Path, int],
    tmp_path: Path,
    breakage: str,
) -> None:
    (pod,) = pod_factory(1)
    cert, key, serial = pair
    act = activator_factory(tls_config([pod], cert, key))
    assert served_serial(act, authority) == serial

    if breakage == "key-not-matching":
        other = tmp_path / "other"
        other.mkdir()
        authority.issue(other / "server.crt", other / "server.key")
        shutil.copy(other / "server.key", tmp_path / ".server.key.new")
        os.replace(tmp_path / ".server.key.new", key)
    else:
        key.unlink()
    act.reload()

    st = act.wait_for(lambda st: st["config"]["last_error"], message="the bad pair reported")
    error = st["config"]["last_error"]
    assert "tls" in error and key.name in error, error
    # The old pair still serves new handshakes, and requests go through.
    assert served_serial(act, authority) == serial
    conn = https(act, authority)
    try:
        assert echo(conn)["headers"]["x-forwarded-proto"] == "https"
    finally:
        conn.close()
    settle(act, pod)


def bad_pair(kind: str, authority: Authority, tmp_path: Path) -> tuple[Path, Path]:
    """A (cert, key) that cannot serve: ``key-not-matching`` (two pairs crossed) or
    ``cert-missing`` / ``key-missing`` (a file that is not there)."""
    cert, key = tmp_path / "bad.crt", tmp_path / "bad.key"
    authority.issue(cert, key)
    if kind == "key-not-matching":
        authority.issue(tmp_path / "other.crt", key)
    else:
        (cert if kind == "cert-missing" else key).unlink()
    return cert, key


@pytest.mark.parametrize("kind", ["good", "key-not-matching", "cert-missing", "key-missing"])
def test_check_validates_the_pair(
    authority: Authority, pair: tuple[Path, Path, int], tmp_path: Path, kind: str
) -> None:
    cert, key = pair[:2] if kind == "good" else bad_pair(kind, authority, tmp_path)
    config = tmp_path / "activator.yaml"
    config.write_text(
        f"listen: {LOCALHOST}:8443\nadmin: null\ntls:\n  cert: {cert}\n  key: {key}\n"
        "services:\n  api:\n    hosts: ['*']\n    container_concurrency: 1\n    pods: [127.0.0.1:9]\n"
    )

    result = run_cli(["check", "-c", str(config)])

    if kind == "good":
        assert result.returncode == 0, result.stderr
        assert str(cert) in result.stdout, result.stdout
        return
    assert result.returncode == 2, (result.stdout, result.stderr)
    named = cert if kind == "cert-missing" else key
    assert "activator.yaml" in result.stderr and "tls" in result.stderr, result.stderr
    assert named.name in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["key-not-matching", "cert-missing"])
def test_run_with_a_bad_pair_exits_2(
    activator_factory: ActivatorFactory, authority: Authority, tmp_path: Path, kind: str
) -> None:
    cert, key = bad_pair(kind, authority, tmp_path)
    act = activator_factory(
        make_config([f"{LOCALHOST}:9"], top={"tls": {"cert": str(cert), "key": str(key)}}), start=False
    )

    act.start(wait_ready=False)

    assert act.wait(DEFAULT_TIMEOUT) == 2, act.output_tail()
    assert "tls" in act.stderr_text(), act.output_tail()
