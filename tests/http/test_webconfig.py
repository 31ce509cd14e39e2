"""web-config.yml: validation, and a real HTTPS server hit by a real HTTPS client.

Certificates come from trustme (a throwaway CA per test module); the
client is urllib/ssl from the standard library, as Prometheus would be
anything that speaks TLS.
"""

from __future__ import annotations

import base64
import http.client
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import trustme

from gpuwatchd.errors import ConfigError
from gpuwatchd.http import webconfig
from gpuwatchd.http.server import serve

PASSWORD = "s3cret-scrape"
# cost 4 keeps the suite fast; production hashes use 10-12 (htpasswd -nBC 10)
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {
        "ca": d / "ca.pem",
        "server": d / "server.pem",
        "client": d / "client.pem",
        "client_other_san": d / "client-other.pem",
        "untrusted_client": d / "untrusted.pem",
        "other_ca": d / "other-ca.pem",
        "other_server": d / "other-server.pem",
    }
    ca.cert_pem.write_to_path(files["ca"])
    other.cert_pem.write_to_path(files["other_ca"])
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        files["server"]
    )
    other.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        files["other_server"]
    )
    ca.issue_cert("prometheus.monitoring.svc").private_key_and_cert_chain_pem.write_to_path(
        files["client"]
    )
    ca.issue_cert("intruder.example").private_key_and_cert_chain_pem.write_to_path(
        files["client_other_san"]
    )
    other.issue_cert("prometheus.monitoring.svc").private_key_and_cert_chain_pem.write_to_path(
        files["untrusted_client"]
    )
    return files


class App:
    """A WSGI app that counts the requests that reached it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.calls += 1
        body = f"hello {environ['PATH_INFO']}\n".encode()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [body]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def start(yaml_text: str | None) -> tuple[str, App]:
        web = None
        if yaml_text is not None:
            path = tmp_path / "web-config.yml"
            path.write_text(yaml_text)
            web = webconfig.load(str(path))
        app = App()
        httpd, _thread = serve(app, "127.0.0.1", 0, web)
        started.append(httpd)
        scheme = "https" if web is not None and web.context is not None else "http"
        return f"{scheme}://127.0.0.1:{httpd.server_address[1]}", app

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def client_context(pki: dict[str, Path], cert: str | None = None, ca: str = "ca") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki[ca]))
    if cert:
        ctx.load_cert_chain(str(pki[cert]))
    return ctx


def get(
    url: str, ctx: ssl.SSLContext | None = None, user: str = "", password: str = ""
) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url)
    if user:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


REFUSED = (urllib.error.URLError, ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)


def tls_yaml(pki: dict[str, Path], extra: str = "") -> str:
    return (
        f"tls_server_config:\n  cert_file: {pki['server']}\n  key_file: {pki['server']}\n" + extra
    )


# --- basic auth over TLS ------------------------------------------------------------


def test_https_with_good_password(server: Any, pki: dict[str, Path]) -> None:
    url, app = server(tls_yaml(pki) + f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    status, body, _ = get(url + "/metrics", client_context(pki), "prometheus", PASSWORD)
    assert (status, body) == (200, b"hello /metrics\n")
    # the cached verdict serves the next scrape the same way
    assert get(url + "/metrics", client_context(pki), "prometheus", PASSWORD)[0] == 200
    assert app.calls == 2


@pytest.mark.parametrize(
    ("user", "password"),
    [("prometheus", "wrong"), ("nobody", PASSWORD), ("", ""), ("prometheus", PASSWORD + "x")],
)
def test_https_rejects_bad_credentials(
    server: Any, pki: dict[str, Path], user: str, password: str
) -> None:
    url, app = server(tls_yaml(pki) + f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    status, _body, headers = get(url + "/status", client_context(pki), user, password)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith('Basic realm="gpuwatchd"')
    assert app.calls == 0


def test_healthz_needs_no_credentials(server: Any, pki: dict[str, Path]) -> None:
    url, app = server(tls_yaml(pki) + f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    assert get(url + "/healthz", client_context(pki))[0] == 200
    assert get(url + "/metrics", client_context(pki))[0] == 401


def test_htpasswd_2y_hashes_work(server: Any) -> None:
    # htpasswd and most web tools write $2y$; Python's bcrypt writes $2b$
    url, _ = server(f"basic_auth_users:\n  alice: '{HASH.replace('$2b$', '$2y$', 1)}'\n")
    assert get(url + "/metrics", None, "alice", PASSWORD)[0] == 200
    assert get(url + "/metrics", None, "alice", "nope")[0] == 401


def test_client_must_trust_server_certificate(server: Any, pki: dict[str, Path]) -> None:
    url, app = server(tls_yaml(pki))
    with pytest.raises(REFUSED):
        get(url + "/metrics", client_context(pki, ca="other_ca"))
    assert get(url + "/metrics", client_context(pki))[0] == 200


# --- client certificates ------------------------------------------------------------

MTLS = "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca}\n"


def test_mtls_accepts_trusted_client(server: Any, pki: dict[str, Path]) -> None:
    url, app = server(tls_yaml(pki, MTLS.format(ca=pki["ca"])))
    assert get(url + "/metrics", client_context(pki, "client"))[0] == 200
    assert app.calls == 1


@pytest.mark.parametrize("cert", [None, "untrusted_client"])
def test_mtls_rejects_missing_or_untrusted_client(
    server: Any, pki: dict[str, Path], cert: str | None
) -> None:
    url, app = server(tls_yaml(pki, MTLS.format(ca=pki["ca"])))
    with pytest.raises(REFUSED):
        get(url + "/metrics", client_context(pki, cert))
    assert app.calls == 0


def test_verify_if_given_allows_no_cert_but_not_a_bad_one(
    server: Any, pki: dict[str, Path]
) -> None:
    extra = f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki['ca']}\n"
    url, app = server(tls_yaml(pki, extra))
    assert get(url + "/metrics", client_context(pki))[0] == 200
    with pytest.raises(REFUSED):
        get(url + "/metrics", client_context(pki, "untrusted_client"))
    assert app.calls == 1


def test_client_allowed_sans(server: Any, pki: dict[str, Path]) -> None:
    extra = MTLS.format(ca=pki["ca"]) + "  client_allowed_sans: [prometheus.monitoring.svc]\n"
    url, app = server(tls_yaml(pki, extra))
    assert get(url + "/metrics", client_context(pki, "client"))[0] == 200
    with pytest.raises(REFUSED):
        get(url + "/metrics", client_context(pki, "client_other_san"))
    assert app.calls == 1


def test_min_version_is_enforced(server: Any, pki: dict[str, Path]) -> None:
    url, _ = server(tls_yaml(pki, "  min_version: TLS13\n"))
    old = client_context(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(REFUSED):
        get(url + "/metrics", old)
    assert get(url + "/metrics", client_context(pki))[0] == 200


def test_certificate_rotation_is_picked_up(
    server: Any, pki: dict[str, Path], tmp_path: Path
) -> None:
    cert = tmp_path / "rotating.pem"
    shutil.copy(pki["server"], cert)
    url, _ = server(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {cert}\n")
    assert get(url + "/metrics", client_context(pki))[0] == 200
    shutil.copy(pki["other_server"], cert)
    assert get(url + "/metrics", client_context(pki, ca="other_ca"))[0] == 200
    # a broken replacement keeps the last good certificate
    cert.write_text("not a certificate\n")
    assert get(url + "/metrics", client_context(pki, ca="other_ca"))[0] == 200


def test_plain_http_and_headers(server: Any) -> None:
    url, _ = server("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    status, _, headers = get(url + "/metrics")
    assert status == 200
    assert headers["X-Frame-Options"] == "deny"


def test_no_web_config_is_plain_http(server: Any) -> None:
    url, _ = server(None)
    assert url.startswith("http://")
    assert get(url + "/metrics")[0] == 200


# --- validation ---------------------------------------------------------------------


def test_empty_path_and_empty_file(tmp_path: Path) -> None:
    assert webconfig.load("").context is None
    (tmp_path / "w.yml").write_text("")
    web = webconfig.load(str(tmp_path / "w.yml"))
    assert web.context is None and not web.users


def test_relative_paths_are_relative_to_the_file(tmp_path: Path, pki: dict[str, Path]) -> None:
    shutil.copy(pki["server"], tmp_path / "server.pem")
    (tmp_path / "w.yml").write_text(
        "tls_server_config:\n  cert_file: server.pem\n  key_file: ./server.pem\n"
    )
    web = webconfig.load(str(tmp_path / "w.yml"))
    assert web.tls is not None and web.tls.cert_file == str(tmp_path / "server.pem")


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("tls_config: {}\n", "tls_config", "unknown key"),
        ("tls_server_config: []\n", "tls_server_config", "must be a mapping"),
        ("tls_server_config:\n  cert_file: {server}\n", "tls_server_config.key_file", "missing"),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {missing}\n",
            "tls_server_config.cert_file",
            "cannot load",
        ),
        (
            "tls_server_config:\n  cert_file: {ca}\n  key_file: {server}\n",
            "tls_server_config.cert_file",
            "cannot load",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "tls_server_config.client_ca_file",
            "required",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  client_auth_type: RequireAnyClientCert\n  client_ca_file: {ca}\n",
            "tls_server_config.client_auth_type",
            "not supported",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  client_auth_type: Sometimes\n",
            "tls_server_config.client_auth_type",
            "unknown value",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  min_version: TLS13\n  max_version: TLS12\n",
            "tls_server_config.min_version",
            "above",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  min_version: SSL3\n",
            "tls_server_config.min_version",
            "one of",
        ),
        (
            "tls_server_config:\n  cert_file: {server}\n  key_file: {server}\n"
            "  cipher_suites: [TLS_FANCY]\n",
            "tls_server_config.cipher_suites[0]",
            "unknown cipher",
        ),
        (
            "tls_server_config:\n  cert: inline\n",
            "tls_server_config.cert",
            "inline PEM",
        ),
        ("tls_server_config:\n  client_ca_file: {ca}\n", "tls_server_config.cert_file", "required"),
        ("basic_auth_users:\n  alice: plaintext\n", "basic_auth_users.alice", "bcrypt"),
        ("basic_auth_users:\n  'a:b': '{hash}'\n", "basic_auth_users.a:b", "without ':'"),
        ("basic_auth_users: [alice]\n", "basic_auth_users", "must be a mapping"),
        (
            "http_server_config:\n  headers:\n    Server: gpuwatchd\n",
            "http_server_config.headers.Server",
            "not one of",
        ),
        (
            "http_server_config:\n  headers:\n    X-Content-Type-Options: sniff\n",
            "http_server_config.headers.X-Content-Type-Options",
            "nosniff",
        ),
        ("tls_server_config: [\n", "line 2", "invalid YAML"),
    ],
)
def test_bad_files_name_file_key_and_problem(
    tmp_path: Path, pki: dict[str, Path], text: str, key: str, problem: str
) -> None:
    path = tmp_path / "web-config.yml"
    path.write_text(
        text.replace("{server}", str(pki["server"]))
        .replace("{ca}", str(pki["ca"]))
        .replace("{missing}", str(tmp_path / "missing.pem"))
        .replace("{hash}", HASH)
    )
    with pytest.raises(ConfigError) as err:
        webconfig.load(str(path))
    assert err.value.path == str(path)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(err.value).startswith(f"{path}: ")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        webconfig.load(str(tmp_path / "absent.yml"))


@pytest.mark.parametrize("suite", sorted(webconfig.CIPHERS))
def test_every_cipher_name_is_known_to_openssl(suite: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_ciphers(webconfig.CIPHERS[suite])
