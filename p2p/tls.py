"""Per-run PKI: one CA and one certificate per region (EC P-256), for mutual TLS.

``make_pki(dir, regions)`` writes ``ca.pem``, ``ca.key`` and ``<region>.pem`` / ``<region>.key``
into `dir` (mode 0700; every file 0600). A region certificate names the region twice: as its
subject common name (what a server reads from the peer to know who is calling) and as a DNS
subject alternative name (what a client checks when it dials that region, through a proxy or
not, via ``grpc.ssl_target_name_override``). A certificate from another run's CA, or one for
another region, is therefore refused in both directions.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "TlsMaterial", "make_pki", "load_tls", "certificate_region", "renew_expiring", "issue_region",
           "RENEW_WITHIN_DAYS"]

# A resumed run renews certificates that expire within this many days (or have expired).
RENEW_WITHIN_DAYS = 7


@dataclass(frozen=True, kw_only=True)
class TlsMaterial:
    """What one region needs for mutual TLS: the run's CA and its own certificate and key."""

    region: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:  # never print the key
        return f"TlsMaterial(region={self.region!r})"

    def server_credentials(self, on_connection: Callable[[], None] | None = None) -> Any:
        """Server credentials requiring a client certificate from the run's CA. With
        ``on_connection``, it is called for every connection the server accepts, before the
        handshake (``p2p/handshakes.py``: how refused handshakes are counted)."""
        import grpc

        if on_connection is None:
            return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                               require_client_auth=True)

        def fetch() -> None:  # called by gRPC core per accepted connection; None keeps the certificate
            on_connection()
            return None

        config = grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)],
                                                           root_certificates=self.ca_pem)
        return grpc.dynamic_ssl_server_credentials(config, fetch, require_client_authentication=True)

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)


@dataclass(frozen=True, kw_only=True)
class Pki:
    """A run's PKI as `make_pki` wrote it: the folder, the CA certificate and the regions with a certificate."""

    directory: Path
    ca_cert: Path
    regions: tuple[str, ...]

    def material(self, region: str) -> TlsMaterial:
        """Load `region`'s TLS material from the folder (see `load_tls` for the checks)."""
        return load_tls(self.directory, region)


def _write_private(path: Path, data: bytes) -> None:
    # Created 0600 from the start (not chmod'ed after), so the key is never readable by others.
    # O_NOFOLLOW: a run directory is anyone's files; a symlink planted at tls/ca.pem must not
    # turn a renewal into a write over the file it points at (issue 36, N13).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # O_CREAT does not change the mode of an existing file


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "geofed"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(run_name: str = "geofed-run", *, valid_days: int = 30,
            key: ec.EllipticCurvePrivateKey | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA; with `key`, a renewal of that CA (same key and name: what it signed still verifies)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(f"{run_name} CA")).issuer_name(_name(f"{run_name} CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, region: str, *,
          valid_days: int = 30) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate for `region`, usable as TLS server and client."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(region)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=valid_days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(region)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def make_pki(directory: Path, regions: Sequence[str], *, valid_days: int = 30) -> Pki:
    """A fresh CA and one certificate per region in `directory` (created 0700; files 0600)."""
    directory = Path(directory)
    if not regions:
        raise ValueError("regions: need at least one region")
    if len(set(regions)) != len(regions):
        raise ValueError(f"regions: duplicate names in {list(regions)}")
    for r in regions:
        _check_region_name(r)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    ca_key, ca_cert = make_ca(directory.name or "geofed-run", valid_days=valid_days)
    _write_private(directory / "ca.key", _key_pem(ca_key))
    _write_private(directory / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    for region in regions:
        _write_region(directory, ca_key, ca_cert, region, valid_days=valid_days)
    return Pki(directory=directory, ca_cert=directory / "ca.pem", regions=tuple(regions))


def _check_region_name(region: str) -> None:
    if not region or region in ("ca",) or "/" in region or region.startswith("."):
        raise ValueError(f"regions: {region!r} cannot name a certificate file")


def _write_region(directory: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, region: str, *,
                  valid_days: int) -> None:
    key, cert = issue(ca_key, ca_cert, region, valid_days=valid_days)
    _write_private(directory / f"{region}.key", _key_pem(key))
    _write_private(directory / f"{region}.pem", cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_key = serialization.load_pem_private_key(_read(directory / "ca.key"), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'}: not an elliptic-curve key (make_pki writes one)")
    return ca_key, x509.load_pem_x509_certificate(_read(directory / "ca.pem"))


def issue_region(directory: Path, region: str, *, valid_days: int = 30) -> TlsMaterial:
    """A certificate for `region` from the run's own CA in `directory` (as make_pki issues each
    region's; the CA key never leaves the folder): a region that joins a live run under a new name
    (orchestrator/driver/membership.py). Its files are written over, if any; returns its material."""
    directory = Path(directory)
    _check_region_name(region)
    ca_key, ca_cert = _load_ca(directory)
    _write_region(directory, ca_key, ca_cert, region, valid_days=valid_days)
    return load_tls(directory, region)


def renew_expiring(directory: Path, regions: Sequence[str], *, within_days: float = RENEW_WITHIN_DAYS,
                   valid_days: int = 30) -> list[str]:
    """Renew, from the run's own CA key (ca.key), every certificate in `directory` that has expired
    or expires within `within_days`; returns the names renewed ("ca" and/or regions), [] when all
    are good. A renewed CA keeps its key and name, and every region certificate is then reissued too."""
    directory = Path(directory)
    ca_key, ca_cert = _load_ca(directory)
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=within_days)
    renewed = []
    if ca_cert.not_valid_after_utc <= soon:
        cn = str(ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value).removesuffix(" CA")
        _, ca_cert = make_ca(cn, valid_days=valid_days, key=ca_key)
        _write_private(directory / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
        renewed.append("ca")
    for region in regions:
        cert = x509.load_pem_x509_certificate(_read(directory / f"{region}.pem"))
        if renewed or cert.not_valid_after_utc <= soon:
            _write_region(directory, ca_key, ca_cert, region, valid_days=valid_days)
            renewed.append(region)
    return renewed


MAX_PEM_BYTES = 1 << 20  # a key, a certificate or a chain of them is a few KiB


def _read(path: Path) -> bytes:
    """A PEM file of a TLS folder: a regular file (symlinks to one are fine: mounted secrets are
    links), at most MAX_PEM_BYTES. Opened non-blocking and checked on the descriptor, so a FIFO or
    /dev/zero in a resumed run directory's tls/ is refused instead of hanging or filling memory."""
    if not path.exists():
        raise FileNotFoundError(f"TLS file missing: {path}")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file; a TLS file must be one")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file; a TLS file must be one")
        data = f.read(MAX_PEM_BYTES + 1)
    if len(data) > MAX_PEM_BYTES:
        raise ValueError(f"{path}: over {MAX_PEM_BYTES} bytes; a TLS file is a few KiB of PEM")
    return data


def load_tls(directory: Path, region: str) -> TlsMaterial:
    """Load `region`'s material; refuses a key file that others can read."""
    directory = Path(directory)
    key_path = directory / f"{region}.key"
    key_pem = _read(key_path)
    mode = stat.S_IMODE(key_path.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(f"{key_path}: private key has mode {mode:o}; it must be 0600")
    cert_pem = _read(directory / f"{region}.pem")
    named = certificate_region(cert_pem)
    if named != region:
        raise ValueError(f"region: {directory / (region + '.pem')} is a certificate for {named!r}, not {region!r}")
    return TlsMaterial(region=region, ca_pem=_read(directory / "ca.pem"), cert_pem=cert_pem, key_pem=key_pem)


def certificate_region(cert_pem: bytes) -> str:
    """The region a PEM certificate names (its one subject common name); ValueError for none or several."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise ValueError(f"certificate: expected one common name, got {len(names)}")
    return str(names[0].value)
