"""Issue 19, trap: TLS certificates expire after 30 days and `--resume` reused them without
checking. A resume now renews, from the run's own CA key, the certificates expiring within
RENEW_WITHIN_DAYS (or expired), and reissues every region's when the CA itself is renewed."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.setup import make_tls
from geofed.p2p.tls import issue, load_tls, make_pki, renew_expiring
from cryptography.hazmat.primitives import serialization

REGIONS = ["us-east-1", "eu-west-1"]


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _expires_in_days(path) -> float:
    return (_cert(path).not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).total_seconds() / 86400


def test_fresh_certificates_are_kept(tmp_path):
    make_pki(tmp_path, REGIONS)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert renew_expiring(tmp_path, REGIONS) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_expired_region_certificate_is_renewed_from_the_run_ca(tmp_path):
    make_pki(tmp_path, REGIONS)
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), password=None)
    _, old = issue(ca_key, _cert(tmp_path / "ca.pem"), "eu-west-1", valid_days=0)  # expires now
    (tmp_path / "eu-west-1.pem").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    ca_before = (tmp_path / "ca.pem").read_bytes()
    assert renew_expiring(tmp_path, REGIONS) == ["eu-west-1"]
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    assert _expires_in_days(tmp_path / "eu-west-1.pem") > 29
    _cert(tmp_path / "eu-west-1.pem").verify_directly_issued_by(_cert(tmp_path / "ca.pem"))
    assert load_tls(tmp_path, "eu-west-1").region == "eu-west-1"  # key matches, mode 0600


def test_an_expiring_ca_is_renewed_with_its_key_and_every_region_reissued(tmp_path):
    make_pki(tmp_path, REGIONS, valid_days=3)
    ca_key_before = (tmp_path / "ca.key").read_bytes()
    assert renew_expiring(tmp_path, REGIONS) == ["ca", *REGIONS]
    assert (tmp_path / "ca.key").read_bytes() == ca_key_before  # the run's CA, renewed, not replaced
    for name in ["ca", *REGIONS]:
        assert _expires_in_days(tmp_path / f"{name}.pem") > 29
    for r in REGIONS:
        _cert(tmp_path / f"{r}.pem").verify_directly_issued_by(_cert(tmp_path / "ca.pem"))


def test_resume_renews_expiring_certificates(tmp_path, capsys):
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "regions": {"names": REGIONS},
                              "network": {"emulation": {"mode": "none"}}})
    make_pki(tmp_path / "tls", REGIONS, valid_days=2)  # a run directory whose certificates expire in 2 days
    make_tls(tmp_path, list(cfg.regions.names), resume=True)
    assert all(_expires_in_days(tmp_path / "tls" / f"{n}.pem") > 29 for n in ["ca", *REGIONS])
    assert "renewed TLS certificates expiring within 7 days from the run's CA: ca, us-east-1, eu-west-1" in capsys.readouterr().err
