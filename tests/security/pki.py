"""A throwaway PKI for the security tests: two CAs, a server certificate (localhost, 127.0.0.1, ::1)
and client certificates, written as PEM files. Uses the `cryptography` package when installed, else
the `openssl` command; the tests skip when neither is there."""

from __future__ import annotations

import datetime
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAMES = ("localhost",)
SERVER_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Pki:
    ca: Path  # signs server.pem and client.pem
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA: signs stranger.pem
    stranger_cert: Path
    stranger_key: Path


def available() -> bool:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return shutil.which("openssl") is not None
    return True


def make_pki(root: Path) -> Pki:
    root.mkdir(parents=True, exist_ok=True)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return _with_openssl(root)
    return _with_cryptography(root)


# ------------------------------------------------------------------------------ cryptography


def _with_cryptography(root: Path) -> Pki:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def ca(common: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(name(common))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(common: str, issuer, server: bool):
        issuer_key, issuer_cert = issuer
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(issuer_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False))
        if server:
            sans = [x509.DNSName(n) for n in SERVER_NAMES]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_IPS]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, key, cert) -> tuple[Path, Path]:
        cert_path, key_path = root / f"{stem}.pem", root / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key_pem(key))
        key_path.chmod(0o600)
        return cert_path, key_path

    main_ca, other_ca = ca("specdec test CA"), ca("another CA")
    ca_path, _ = write("ca", *main_ca)
    other_path, _ = write("other-ca", *other_ca)
    server = write("server", *leaf("specdec test server", main_ca, server=True))
    client = write("client", *leaf("orchestrator", main_ca, server=False))
    stranger = write("stranger", *leaf("stranger", other_ca, server=False))
    return Pki(ca_path, *server, *client, other_path, *stranger)


# ------------------------------------------------------------------------------ openssl


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _with_openssl(root: Path) -> Pki:
    def ca(stem: str, common: str) -> None:
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{stem}.key", "-out", f"{stem}.pem", "-days", "2", "-subj", f"/CN={common}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", cwd=root)

    def leaf(stem: str, common: str, issuer: str, extensions: str) -> None:
        (root / f"{stem}.ext").write_text(extensions)
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", f"/CN={common}", cwd=root)
        _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", f"{issuer}.pem", "-CAkey", f"{issuer}.key",
                 "-CAcreateserial", "-out", f"{stem}.pem", "-days", "2", "-extfile", f"{stem}.ext", cwd=root)

    ca("ca", "specdec test CA")
    ca("other-ca", "another CA")
    sans = ",".join([*(f"DNS:{n}" for n in SERVER_NAMES), *(f"IP:{ip}" for ip in SERVER_IPS)])
    leaf("server", "specdec test server", "ca",
         f"basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    leaf("client", "orchestrator", "ca", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    leaf("stranger", "stranger", "other-ca", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    for key in root.glob("*.key"):
        key.chmod(0o600)
    return Pki(root / "ca.pem", root / "server.pem", root / "server.key", root / "client.pem",
               root / "client.key", root / "other-ca.pem", root / "stranger.pem", root / "stranger.key")
