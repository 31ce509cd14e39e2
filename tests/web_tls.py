"""A web config file with TLS (a trustme CA's certificate for 127.0.0.1) and basic auth."""

from __future__ import annotations

from pathlib import Path

import bcrypt
import trustme


def tls_basic_auth_web(tmp: Path, password: str, user: str = "prom") -> tuple[Path, Path]:
    """(the CA file clients trust, the web config file) under `tmp`."""
    ca = trustme.CA()
    ca_file, server_file = tmp / "ca.pem", tmp / "server.pem"
    ca.cert_pem.write_to_path(ca_file)
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(server_file)
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    web = tmp / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {server_file}\n  key_file: {server_file}\n"
        f"basic_auth_users:\n  {user}: '{hashed}'\n"
    )
    return ca_file, web
