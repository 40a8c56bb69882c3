"""The control plane's certificates (openssl) and the kubeconfigs that name them.

One CA per control plane signs the API server's serving certificate, the client certificates
(the admin, the controller manager) and, for the real node, the `kubernetes` Service relay's
serving certificate (:class:`hack.node_run.ServiceProxy`). Standard library + the openssl CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: EC P-256: quick to generate on a small VM. (RSA only where a client needs it.)
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


class PkiError(RuntimeError):
    """openssl is missing or refused a step; the message carries its stderr."""


def openssl(*args: str, cwd: Path) -> None:
    """Run the openssl CLI in ``cwd``; PkiError with its stderr when it fails."""
    binary = shutil.which("openssl")
    if binary is None:
        raise PkiError("`openssl` is required to generate the control plane's certificates")
    proc = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Pki:
    """Certificates for one control plane: a CA, the apiserver serving cert, client certs and
    the service-account signing key pair, as files in ``dir``."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @classmethod
    def create(cls, directory: Path) -> Pki:
        """A fresh CA and every certificate the control plane's processes need."""
        directory.mkdir(parents=True, exist_ok=True)
        pki = cls(directory)
        openssl(
            "req",
            "-x509",
            *EC_KEY,
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=offloadpool-test-ca",
            cwd=directory,
        )
        pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        # system:masters: the admin; the controller manager gets its own RBAC identity.
        pki.issue("admin", "/O=system:masters/CN=offloadpool-admin", "extendedKeyUsage=clientAuth\n")
        pki.issue("controller-manager", "/CN=system:kube-controller-manager", "extendedKeyUsage=clientAuth\n")
        openssl(
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            "sa.key",
            cwd=directory,
        )
        openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
        return pki

    def issue(
        self,
        name: str,
        subject: str,
        extensions: str,
        key: tuple[str, ...] = EC_KEY,
        days: int = 365,
    ) -> tuple[Path, Path]:
        """A key and a certificate signed by the CA, as ``<name>.key``/``<name>.crt``;
        ``extensions`` is an openssl extfile (subjectAltName, extendedKeyUsage)."""
        ext = self.dir / f"{name}.ext"
        ext.write_text(extensions)
        openssl(
            "req", "-new", *key, "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
            cwd=self.dir,
        )  # fmt: skip
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(int.from_bytes(os.urandom(8), "big")),
            "-days",
            str(days),
            "-extfile",
            ext.name,
            "-out",
            f"{name}.crt",
            cwd=self.dir,
        )
        return self.crt(name), self.key(name)


def write_kubeconfig(
    path: Path, server: str, ca: Path, user: dict[str, str], name: str = "offloadpool-test"
) -> Path:
    """A kubeconfig that names its certificate files (``certificate-authority``,
    ``client-certificate``/``client-key``) instead of embedding them.

    Why not embed (``*-data``): the Python kubernetes client writes embedded certificates and
    keys to ``/tmp/tmpXXXX`` files and removes them only at interpreter exit, so every process a
    test kills with SIGKILL would leave them behind. The files live in the control plane's work
    dir for as long as it runs. JSON is valid kubeconfig YAML."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path
