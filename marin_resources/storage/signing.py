"""Signed bills of materials: an Ed25519 signature over a BOM's canonical JSON (which holds the
chain hash and every file's sha256), and a check that re-hashes every artifact it lists.

Keys are PEM files: PKCS#8 private keys and SubjectPublicKeyInfo public keys, as `marin keygen`
or `openssl genpkey -algorithm ed25519` write them.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from marin_resources.storage.identity import canonical_json
from marin_resources.storage.lineage import bill_of_materials, build_lineage
from marin_resources.storage.store import ArtifactStore

ALGORITHM = "ed25519"


class SignatureError(ValueError):
    """A key that is not an Ed25519 PEM key, or a signed BOM file of the wrong shape."""


def generate_keypair(private_path: str | Path) -> tuple[Path, Path]:
    """Write a new private key (mode 0600, never overwriting one) and its public key beside it (`.pub`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # refuses to replace a key
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def _private_key(path: str | Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path}: a {type(key).__name__}, not an Ed25519 key")
    return key


def _public_key(path: str | Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except ValueError as exc:
        raise SignatureError(f"{path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path}: a {type(key).__name__}, not an Ed25519 key")
    return key


def _raw_public(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign_bom(bom: dict[str, Any], private_key: str | Path) -> dict[str, Any]:
    """`{"bom": ..., "signature": ...}`: the signature covers the BOM's canonical JSON bytes."""
    key = _private_key(private_key)
    payload = canonical_json(bom).encode("utf-8")
    return {"bom": bom, "signature": {
        "algorithm": ALGORITHM,
        "signed": "canonical JSON of `bom` (sorted keys, no whitespace, UTF-8)",
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "public_key": base64.b64encode(_raw_public(key.public_key())).decode(),
        "value": base64.b64encode(key.sign(payload)).decode(),
    }}


def verify_signed_bom(store: ArtifactStore, signed: dict[str, Any], public_key: str | Path) -> list[str]:
    """Problems with a signed BOM; empty when the signature is good for this public key and every
    listed artifact's bytes in the store still hash to what the BOM lists, chain hash included."""
    from cryptography.exceptions import InvalidSignature

    try:
        bom, signature = signed["bom"], signed["signature"]
        value = base64.b64decode(signature["value"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise SignatureError("not a signed bill of materials (expected {'bom': ..., 'signature': {...}})") from None
    if signature.get("algorithm") != ALGORITHM:
        return [f"signature algorithm {signature.get('algorithm')!r} is not {ALGORITHM}"]
    key = _public_key(public_key)
    try:
        key.verify(value, canonical_json(bom).encode("utf-8"))
    except InvalidSignature:
        return ["signature does not match the BOM and this public key (the BOM was changed, or signed by "
                "another key)"]
    return rehash(store, bom)


def rehash(store: ArtifactStore, bom: dict[str, Any]) -> list[str]:
    """Every file of every artifact the BOM lists, hashed again from the store, and the chain hash
    recomputed from a verifying walk of the root's lineage."""
    problems = []
    for artifact in bom["artifacts"]:
        if artifact.get("external"):
            continue  # outside the store: its listing hash is in the chain
        uri = artifact["uri"]
        if not uri.startswith(store.prefix + "/"):
            problems.append(f"{uri}: not under this store's prefix {store.prefix}")
            continue
        present = set(store.list_files(uri))
        for entry in artifact.get("files", []):
            if entry["path"] not in present:
                problems.append(f"{uri}/{entry['path']}: missing")
                continue
            found = store.hash_file(uri, entry["path"])
            if found.sha256 != entry["sha256"] or found.bytes != entry["bytes"]:
                problems.append(f"{uri}/{entry['path']}: sha256 {found.sha256[:12]} != signed {entry['sha256'][:12]}")
    root_uri = bom["root"]["uri"]
    manifest = store.read_manifest(root_uri) if root_uri.startswith(store.prefix + "/") else None
    if manifest is None:
        problems.append(f"{root_uri}: no committed artifact")
        return problems
    chain = bill_of_materials(build_lineage(store, manifest, verify=True))["chain_hash"]
    if chain != bom["chain_hash"]:
        problems.append(f"chain hash of the store now {chain[:16]} != signed {bom['chain_hash'][:16]}")
    return problems
