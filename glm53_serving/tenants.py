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

CLI (an operator's tools; every change is written atomically, 0600, and a running gateway
takes it within a second, or at once on SIGHUP):
    python -m glm53_serving.tenants add FILE TENANT      add a tenant, print its new key once
    python -m glm53_serving.tenants rotate FILE TENANT   a new key beside the old ones
    python -m glm53_serving.tenants retire FILE KEY_ID   remove one key (ids from `list`)
    python -m glm53_serving.tenants remove FILE TENANT   remove a tenant
    python -m glm53_serving.tenants list|check FILE      key ids per tenant | validate
    python -m glm53_serving.tenants admin-token KEYFILE --deployment NAME   an admin assertion for curl
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import jwt
import tomli_w

from glm53_serving import env

logger = logging.getLogger("glm53_serving.tenants")

KEY_FILE_ENV = env.ASSERTION_KEY_FILE.name  # set by the launcher on the gateway and every worker
ASSERTION_TTL_S = 120  # what the gateway mints for tenants
# Lifetimes every verifier enforces (exp - iat), whoever minted the assertion: a captured tenant
# assertion replays for minutes at most, an operator token for hours (docs/threat-model.md).
MAX_TTL_S = {"tenant": 600, "admin": 12 * 3600}
LEEWAY_S = 5  # clock skew between the gateway's host and a worker's
KEY_PREFIX = "g53-"
KEY_ID_CHARS = 12
ADMIN = "admin"  # role of an operator's assertion (never a tenant id)
INTERNAL = "__internal__"  # the server's own calls (tenant_guard); never a tenant id, never signed
RESERVED = frozenset({ADMIN, INTERNAL})
TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_KEY_BYTES = 32


class TenantsError(ValueError):
    """A tenants file, tenant id or assertion key that cannot be used (the message names it and the way out)."""


def _require(ok: bool, message: str) -> None:
    # Not `assert`: these checks decide who is an operator and must hold under python -O.
    if not ok:
        raise TenantsError(message)


def check_tenant_id(tenant: object, where: str = "tenant id") -> str:
    _require(
        isinstance(tenant, str) and TENANT_ID.fullmatch(tenant) is not None,
        f"{where}: {tenant!r} is not a tenant id (1-64 of letters, digits, '.', '_', '-'; starting with a letter "
        "or digit)",
    )
    _require(tenant.lower() not in RESERVED, f"{where}: {tenant!r} is reserved ({', '.join(sorted(RESERVED))})")
    return tenant


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header, or None."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's fair share at the gateway (gateway/fair_share.py); 0: unlimited."""

    concurrent: int = 0
    requests_per_minute: int = 0
    prompt_tokens_per_minute: int = 0
    queue_wait_s: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            v, kind = getattr(self, f.name), (int | float) if f.name == "queue_wait_s" else int
            _require(
                not isinstance(v, bool) and isinstance(v, kind) and v >= 0,
                f"limits.{f.name} must be {'a number' if kind is not int else 'an integer'} >= 0, not {v!r}",
            )

    def over(self, table: dict | None) -> TenantLimits:
        """These limits with a tenant's own table over them (unknown keys refused)."""
        if not table:
            return self
        _require(isinstance(table, dict), f"limits must be a table, not {table!r}")
        unknown = set(table) - {f.name for f in fields(self)}
        _require(not unknown, f"limits: unknown {sorted(unknown)} (known: {[f.name for f in fields(self)]})")
        return replace(self, **table)

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "queue_wait_s")


@dataclass(frozen=True, slots=True)
class TenantsFile:
    """`[tenants.<id>] key_sha256 = ["<hex>", ...]`: several hashes per tenant allow key rotation."""

    by_hash: dict[str, str]
    limits: dict[str, dict] = field(default_factory=dict)  # tenant -> its own `limits` table

    @classmethod
    def load(cls, path: Path) -> TenantsFile:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TenantsError(
                f"{path}: no such tenants file (create it with python -m glm53_serving.tenants add {path} TENANT)"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise TenantsError(f"{path}: not TOML: {e}") from None
        entries = data.get("tenants", {})
        _require(isinstance(entries, dict), f"{path}: [tenants] must be a table of tenants")
        by_hash: dict[str, str] = {}
        limits: dict[str, dict] = {}
        for tenant, entry in entries.items():
            check_tenant_id(tenant, f"{path}: [tenants.{tenant}]")
            if isinstance(entry, dict) and "limits" in entry:
                try:
                    TenantLimits().over(entry["limits"])
                except TenantsError as e:
                    raise TenantsError(f"{path}: {tenant}: {e}") from None
                limits[tenant] = dict(entry["limits"])
            hashes = entry.get("key_sha256", []) if isinstance(entry, dict) else None
            _require(isinstance(hashes, list), f"{path}: {tenant}: key_sha256 must be a list of SHA-256 hex digests")
            for h in hashes:
                _require(
                    isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h),
                    f"{path}: {tenant}: bad hash {h!r} (64 lower-case hex digits)",
                )
                _require(h not in by_hash, f"{path}: one key hash listed for {by_hash.get(h)} and {tenant}")
                by_hash[h] = tenant
        return cls(by_hash, limits)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header, or None."""
        who = self.identify(authorization)
        return None if who is None else who[0]

    def identify(self, authorization: str | None) -> tuple[str, str] | None:
        """(tenant, key id) of an `Authorization: Bearer <key>` header, or None."""
        key = bearer(authorization)
        if key is None:
            return None
        h = hash_key(key)
        tenant = self.by_hash.get(h)
        return None if tenant is None else (tenant, key_id(h))

    def keys(self) -> dict[str, list[str]]:
        """tenant -> the ids of its keys (key_id), in file order."""
        out: dict[str, list[str]] = {}
        for h, tenant in self.by_hash.items():
            out.setdefault(tenant, []).append(key_id(h))
        return out


def key_id(key_hash: str) -> str:
    """A key's public id: the first 12 hex digits of its hash (what `list` shows and `retire`
    takes; the key itself is never stored)."""
    return key_hash[:KEY_ID_CHARS]


def _new_key() -> tuple[str, str]:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key)


def _edit(path: Path, change):
    """Apply `change` to the file's `[tenants]` table and write it back atomically (0600); the
    file is read only if it loads, and the new one replaces it only if it loads."""
    path = Path(path)
    data: dict = {}
    if path.exists():
        TenantsFile.load(path)  # never rewrite a file we could not read
        data = tomllib.loads(path.read_text())
    out = change(data.setdefault("tenants", {}))
    write_atomically(path, tomli_w.dumps(data).encode())
    return out


def write_atomically(path: Path, raw: bytes) -> None:
    """Readers (the gateway's reload) see the old file or the new one, never a half-written one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        TenantsFile.load(Path(tmp))  # what we write must load
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def add_tenant(path: Path, tenant: str) -> str:
    """Add `tenant` (or a key for it) with a new key to the file (created 0600 if missing); return the key."""
    check_tenant_id(tenant)
    key, h = _new_key()
    _edit(path, lambda t: t.setdefault(tenant, {}).setdefault("key_sha256", []).append(h))
    return key


def rotate_key(path: Path, tenant: str) -> str:
    """A new key for an existing tenant, beside its others (retire the old one once clients moved)."""

    def change(t):
        _require(tenant in t, f"{path}: no tenant {tenant!r} (add it first)")
        t[tenant].setdefault("key_sha256", []).append(h)

    key, h = _new_key()
    _edit(path, change)
    return key


def retire_key(path: Path, kid: str) -> str:
    """Remove the key with this id; return its tenant. A tenant's last key is not retired (remove
    the tenant instead), so a tenant is never left unable to authenticate by accident."""

    def change(t):
        found = [(tenant, h) for tenant, e in t.items() for h in e.get("key_sha256", []) if key_id(h) == kid]
        _require(len(found) == 1, f"{path}: no key with id {kid!r} (python -m glm53_serving.tenants list {path})")
        tenant, h = found[0]
        _require(len(t[tenant]["key_sha256"]) > 1, f"{path}: {kid} is {tenant}'s last key: remove the tenant instead")
        t[tenant]["key_sha256"].remove(h)
        return tenant

    return _edit(path, change)


def remove_tenant(path: Path, tenant: str) -> None:
    def change(t):
        _require(tenant in t, f"{path}: no tenant {tenant!r}")
        del t[tenant]

    _edit(path, change)


class LiveTenants:
    """The gateway's tenants: the file in force, reloaded when it changes (its stat, polled) or on
    request (SIGHUP). A file that does not load never replaces the one in force: the error is
    logged and counted, and the old keys keep working until a good file arrives."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.current = TenantsFile.load(self.path)
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def tenant_of(self, authorization: str | None) -> str | None:
        return self.current.tenant_of(authorization)

    def identify(self, authorization: str | None) -> tuple[str, str] | None:
        return self.current.identify(authorization)

    def reload(self, force: bool = False) -> str | None:
        """Load the file if it changed (or `force`): "ok" (the new one is in force), "error" (the
        old one stays), or None (unchanged)."""
        stamp = self._stat()
        if stamp == self._stamp and not force:
            return None
        self._stamp = stamp  # a bad file is reported once, not at every poll
        try:
            new = TenantsFile.load(self.path)
        except (TenantsError, OSError) as e:
            logger.error("tenants file not reloaded, the previous one stays in force: %s", e)
            return "error"
        self.current = new
        logger.info("tenants reloaded from %s: %d tenants, %d keys", self.path, len(new.keys()), len(new.by_hash))
        return "ok"


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
    try:
        key = Path(path).read_text().strip().encode()
    except FileNotFoundError:
        raise TenantsError(
            f"{path}: the assertion key file does not exist (create one with python -m glm53_serving.tenants "
            f"new-key {path})"
        ) from None
    _require(len(key) >= MIN_KEY_BYTES, f"{path}: the assertion key is too short ({MIN_KEY_BYTES} bytes at least)")
    return key


def audience(deployment: str | None = None) -> str:
    """A deployment's audience (default: this process's, set by the launcher): an assertion minted
    for another deployment, even one that shares the key by mistake, does not verify here."""
    return f"glm53:{deployment or env.DEPLOYMENT.get()}"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str  # a tenant id, or ADMIN for an operator
    exp: float = 0.0
    jti: str = ""  # the assertion's id: logged, so one captured assertion can be traced

    @property
    def is_admin(self) -> bool:
        return self.tenant == ADMIN


def mint(key: bytes, tenant: str, ttl_s: int = ASSERTION_TTL_S, deployment: str | None = None) -> str:
    role = ADMIN if tenant == ADMIN else "tenant"
    if role == "tenant":
        check_tenant_id(tenant)
    _require(0 < ttl_s <= MAX_TTL_S[role], f"an {role} assertion lives 1 to {MAX_TTL_S[role]} s, not {ttl_s}")
    now = int(time.time())
    claims = {
        "sub": tenant,
        "aud": audience(deployment),
        "iat": now,
        "exp": now + ttl_s,
        "jti": secrets.token_urlsafe(12),
    }
    return jwt.encode(claims, key, algorithm="HS256")


def verify(key: bytes, authorization: str | None) -> Principal | None:
    """The principal of a worker request's `Authorization: Bearer <assertion>`, or None: signed with
    this deployment's key for its audience, not expired, not issued in the future, and living no
    longer than its role allows."""
    token = bearer(authorization)
    if token is None:
        return None
    try:
        claims = jwt.decode(
            token,
            key,
            algorithms=["HS256"],
            audience=audience(),
            options={"require": ["sub", "aud", "exp", "iat", "jti"]},
            leeway=LEEWAY_S,
        )
    except jwt.InvalidTokenError:
        return None
    sub, iat, exp = claims["sub"], claims["iat"], claims["exp"]
    if not isinstance(sub, str) or not all(isinstance(t, int | float) for t in (iat, exp)):
        return None
    if sub != ADMIN and (TENANT_ID.fullmatch(sub) is None or sub.lower() in RESERVED):
        return None
    if exp - iat > MAX_TTL_S[ADMIN if sub == ADMIN else "tenant"]:
        return None
    return Principal(sub, float(exp), str(claims["jti"]))


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
    for name, help_ in (
        ("add", "add a tenant (or a new key for one) and print the key once"),
        ("rotate", "a new key for an existing tenant, beside its others; print it once"),
        ("remove", "remove a tenant and every key of it"),
    ):
        c = sub.add_parser(name, help=help_)
        c.add_argument("file", type=Path)
        c.add_argument("tenant")
    r = sub.add_parser("retire", help="remove one key by its id (from list); never a tenant's last key")
    r.add_argument("file", type=Path)
    r.add_argument("key_id")
    for name, help_ in (("list", "each tenant and its key ids"), ("check", "validate a tenants file")):
        sub.add_parser(name, help=help_).add_argument("file", type=Path)
    k = sub.add_parser("new-key", help="create the deployment's assertion key (0600; refuses to overwrite)")
    k.add_argument("key_file", type=Path)
    t = sub.add_parser("admin-token", help="print an admin assertion for a worker's control endpoints")
    t.add_argument("key_file", type=Path)
    t.add_argument("--ttl-s", type=int, default=300, help=f"its lifetime (at most {MAX_TTL_S[ADMIN]} s)")
    t.add_argument(
        "--deployment",
        default=None,
        help="the deployment it is for ([tenants] deployment; default the topology file's name, e.g. cpu)",
    )
    args = p.parse_args(argv)
    reload_note = "a running gateway takes the change within a second (or at once on SIGHUP)"
    try:
        if args.cmd in ("add", "rotate"):
            key = (add_tenant if args.cmd == "add" else rotate_key)(args.file, args.tenant)
            print(key)
            print(
                f"{args.tenant}: new key {key_id(hash_key(key))} in {args.file}; the key is not stored and will not be "
                f"shown again; {reload_note}",
                file=sys.stderr,
            )
        elif args.cmd == "retire":
            tenant = retire_key(args.file, args.key_id)
            print(f"{tenant}: key {args.key_id} retired; {reload_note}", file=sys.stderr)
        elif args.cmd == "remove":
            remove_tenant(args.file, args.tenant)
            print(f"{args.tenant} removed; {reload_note}", file=sys.stderr)
        elif args.cmd == "list":
            for tenant, kids in sorted(TenantsFile.load(args.file).keys().items()):
                print(f"{tenant}\t{' '.join(kids)}")
        elif args.cmd == "check":
            keys = TenantsFile.load(args.file).keys()
            print(f"{args.file}: ok, {len(keys)} tenants, {sum(map(len, keys.values()))} keys")
        elif args.cmd == "new-key":
            print(f"created {new_assertion_key(args.key_file)}", file=sys.stderr)
        else:
            print(mint(load_assertion_key(args.key_file), ADMIN, args.ttl_s, args.deployment))
    except FileExistsError:
        p.error(
            f"{args.key_file} exists: an assertion key is never overwritten (every process of a deployment uses it)"
        )
    except TenantsError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
