"""Tenants: who a request belongs to, from the client's API key to the worker's KV namespace.

Invariants:
- API keys are never stored: the tenants file holds their SHA-256 hashes only.
- A worker learns a request's tenant only from an assertion signed with the deployment's
  assertion key (HS256 JWT, PyJWT), which only the gateway and the launcher hold; assertions are
  short-lived and bound to this deployment's audience. A request reaching a worker without the
  gateway cannot claim a tenant, and a client can never name its own cache namespace.
- A tenant's prefix-cache namespace (`cache_salt`) is an HMAC of its id under the same key, so it
  is stable across workers and restarts of one deployment, distinct between tenants, and not
  guessable by a client.

CLI (an operator's tools):
    python -m glm53_serving.tenants add FILE TENANT      add a tenant, print its new key once
    python -m glm53_serving.tenants admin-token KEYFILE  a short-lived admin assertion for curl
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jwt
import tomli_w

from glm53_serving import env

KEY_FILE_ENV = env.ASSERTION_KEY_FILE.name  # set by the launcher on the gateway and every worker
AUDIENCE = "glm53-workers"
ASSERTION_TTL_S = 120
KEY_PREFIX = "g53-"
ADMIN = "admin"  # role of an operator's assertion (never a tenant id: see TenantsFile)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantsFile:
    """`[tenants.<id>] key_sha256 = ["<hex>", ...]`: several hashes per tenant allow key rotation."""

    by_hash: dict[str, str]

    @classmethod
    def load(cls, path: Path) -> TenantsFile:
        data = tomllib.loads(Path(path).read_text())
        by_hash: dict[str, str] = {}
        for tenant, entry in data.get("tenants", {}).items():
            assert tenant != ADMIN, f"{path}: '{ADMIN}' is reserved for operator assertions"
            for h in entry.get("key_sha256", []):
                assert len(h) == 64 and all(c in "0123456789abcdef" for c in h), f"{path}: {tenant}: bad hash {h!r}"
                assert h not in by_hash, f"{path}: one key hash listed for {by_hash.get(h)} and {tenant}"
                by_hash[h] = tenant
        return cls(by_hash)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header, or None."""
        if not authorization or not authorization[:7].lower() == "bearer ":
            return None
        return self.by_hash.get(hash_key(authorization[7:].strip()))


def add_tenant(path: Path, tenant: str) -> str:
    """Add `tenant` with a new key to the file (created 0600 if missing); return the key."""
    assert tenant and tenant != ADMIN and all(c.isalnum() or c in "-_." for c in tenant), f"bad tenant id {tenant!r}"
    path = Path(path)
    data = tomllib.loads(path.read_text()) if path.exists() else {}
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    data.setdefault("tenants", {}).setdefault(tenant, {}).setdefault("key_sha256", []).append(hash_key(key))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        tomli_w.dump(data, f)
    TenantsFile.load(path)  # what we wrote must load
    return key


# --- assertions: gateway -> workers -------------------------------------------------------


def new_assertion_key(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def load_assertion_key(path: str | os.PathLike | None = None) -> bytes | None:
    """The deployment's key, from `path` or $GLM53_ASSERTION_KEY_FILE; None: tenants are off."""
    path = path or os.environ.get(KEY_FILE_ENV)
    if not path:
        return None
    key = Path(path).read_text().strip().encode()
    assert len(key) >= 32, f"{path}: the assertion key is too short"
    return key


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str  # a tenant id, or ADMIN for an operator
    exp: float = 0.0

    @property
    def is_admin(self) -> bool:
        return self.tenant == ADMIN


def mint(key: bytes, tenant: str, ttl_s: int = ASSERTION_TTL_S) -> str:
    now = int(time.time())
    return jwt.encode({"sub": tenant, "aud": AUDIENCE, "iat": now, "exp": now + ttl_s}, key, algorithm="HS256")


def verify(key: bytes, authorization: str | None) -> Principal | None:
    """The principal of a worker request's `Authorization: Bearer <assertion>`, or None."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return None
    try:
        claims = jwt.decode(
            authorization[7:].strip(),
            key,
            algorithms=["HS256"],
            audience=AUDIENCE,
            options={"require": ["sub", "aud", "exp", "iat"]},
            leeway=5,
        )
    except jwt.InvalidTokenError:
        return None
    return Principal(str(claims["sub"]), float(claims["exp"]))


class AssertionCache:
    """The gateway mints one assertion per tenant and reuses it for half its lifetime."""

    def __init__(self, key: bytes, ttl_s: int = ASSERTION_TTL_S):
        self.key, self.ttl_s = key, ttl_s
        self._tokens: dict[str, tuple[float, str]] = {}

    def header(self, tenant: str) -> str:
        now = time.time()
        born, token = self._tokens.get(tenant, (0.0, ""))
        if now - born > self.ttl_s / 2:
            token = mint(self.key, tenant, self.ttl_s)
            self._tokens[tenant] = (now, token)
        return f"Bearer {token}"


def cache_salt(key: bytes, tenant: str) -> str:
    """The tenant's prefix-cache namespace on every worker of the deployment."""
    return hmac.new(key, b"cache-namespace:" + tenant.encode(), hashlib.sha256).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.tenants", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="add a tenant (or a new key for one) and print the key once")
    a.add_argument("file", type=Path)
    a.add_argument("tenant")
    k = sub.add_parser("new-key", help="create the deployment's assertion key (0600; refuses to overwrite)")
    k.add_argument("key_file", type=Path)
    t = sub.add_parser("admin-token", help="print an admin assertion for a worker's control endpoints")
    t.add_argument("key_file", type=Path)
    t.add_argument("--ttl-s", type=int, default=300)
    args = p.parse_args(argv)
    if args.cmd == "add":
        key = add_tenant(args.file, args.tenant)
        print(key)
        print(
            f"added a key for tenant {args.tenant!r} to {args.file}; this key is not stored and will not "
            "be shown again",
            file=sys.stderr,
        )
    elif args.cmd == "new-key":
        print(f"created {new_assertion_key(args.key_file)}", file=sys.stderr)
    else:
        print(mint(load_assertion_key(args.key_file), ADMIN, args.ttl_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
