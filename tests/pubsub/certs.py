"""Test-time keys and certificates: a CA, a server certificate for
127.0.0.1/localhost signed by it, and a Google-style service-account key."""

import datetime
import ipaddress
import json
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


def _key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key):
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(directory, cn="loom test CA"):
    """Writes <cn-slug>.pem / -key.pem; returns (cert, key, cert_path)."""
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                           critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    slug = cn.replace(" ", "-")
    path = os.path.join(directory, slug + ".pem")
    with open(path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def make_server_cert(directory, ca_cert, ca_key, name="server"):
    """A cert for localhost and 127.0.0.1; returns (cert_path, key_path)."""
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name("localhost"))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                # nginx checks names with X509_check_host, which ignores IP
                # entries: carry the loopback literal as a DNS name too
                x509.DNSName("127.0.0.1"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path = os.path.join(directory, name + ".pem")
    key_path = os.path.join(directory, name + "-key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(_pem_key(key))
    return cert_path, key_path


def make_service_account(directory, token_uri, email=None):
    """A service-account JSON key file; returns (path, public_key_pem)."""
    key = _key()
    email = email or "loom-test@loom-proj.iam.gserviceaccount.com"
    info = {
        "type": "service_account",
        "project_id": "loom-proj",
        "private_key_id": "kid-%d" % os.getpid(),
        "private_key": _pem_key(key).decode(),
        "client_email": email,
        "client_id": "1234567890",
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
    }
    path = os.path.join(directory, "sa.json")
    with open(path, "w") as f:
        json.dump(info, f)
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM,
        serialization.PublicFormat.SubjectPublicKeyInfo)
    return path, pub, info
