"""Tenant identity: the tenants file, assertions, namespaces, and the worker's route table."""

import os
import subprocess
import sys
import time

import jwt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53_serving import tenants
from glm53_serving.tenant_guard import ROUTES, Access, access_of

KEY = b"k" * 64


def test_add_tenant_stores_only_the_hash_and_the_key_identifies_the_tenant(tmp_path):
    f = tmp_path / "tenants.toml"
    a = tenants.add_tenant(f, "acme")
    b = tenants.add_tenant(f, "beta")
    a2 = tenants.add_tenant(f, "acme")  # a second key for rotation
    text = f.read_text()
    assert a not in text and b not in text and tenants.hash_key(a) in text
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    t = tenants.TenantsFile.load(f)
    assert t.tenant_of(f"Bearer {a}") == "acme" and t.tenant_of(f"bearer {a2}") == "acme"
    assert t.tenant_of(f"Bearer {b}") == "beta"
    for bad in (None, "", a, f"Basic {a}", f"Bearer {a}x", "Bearer ", f"Bearer {tenants.hash_key(a)}"):
        assert t.tenant_of(bad) is None, bad


def test_the_cli_prints_a_new_key_once(tmp_path):
    f = tmp_path / "t.toml"
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.tenants", "add", str(f), "acme"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    key = out.stdout.strip()
    assert key.startswith(tenants.KEY_PREFIX) and "not be shown again" in out.stderr
    assert tenants.TenantsFile.load(f).tenant_of(f"Bearer {key}") == "acme"


@pytest.mark.parametrize("tenant", ["admin", "Admin", "__internal__", "_x", "", "a b", "a/b", "x" * 65, "é"])
def test_reserved_and_malformed_tenant_ids_are_refused(tmp_path, tenant):
    with pytest.raises(tenants.TenantsError):
        tenants.add_tenant(tmp_path / "t.toml", tenant)
    f = tmp_path / "hand-written.toml"
    f.write_text(f'[tenants."{tenant}"]\nkey_sha256 = ["{"0" * 64}"]\n')
    with pytest.raises(tenants.TenantsError, match="tenant id|reserved"):
        tenants.TenantsFile.load(f)


def test_malformed_tenants_files_name_the_problem(tmp_path):
    f = tmp_path / "t.toml"
    for text, words in (
        ('[tenants.acme]\nkey_sha256 = ["abc"]\n', "bad hash"),
        (f'[tenants.acme]\nkey_sha256 = ["{"a" * 64}"]\n[tenants.beta]\nkey_sha256 = ["{"a" * 64}"]\n', "one key"),
        ("[tenants.acme]\nkey_sha256 = 3\n", "must be a list"),
        ("tenants = 3\n", "table"),
        ("[tenants\n", "not TOML"),
    ):
        f.write_text(text)
        with pytest.raises(tenants.TenantsError, match=words):
            tenants.TenantsFile.load(f)
    with pytest.raises(tenants.TenantsError, match="no such tenants file"):
        tenants.TenantsFile.load(tmp_path / "missing.toml")
    f.write_text("[tenants\n")
    with pytest.raises(tenants.TenantsError):
        tenants.add_tenant(f, "acme")  # never rewrites a file it could not read
    assert f.read_text() == "[tenants\n"


LOADERS_UNDER_O = """
import sys, tempfile, pathlib
from glm53_serving import tenants
d = pathlib.Path(tempfile.mkdtemp())
(d / "t.toml").write_text('[tenants.admin]\\nkey_sha256 = ["' + "0" * 64 + '"]\\n')
(d / "k").write_text("short")
for call in (lambda: tenants.TenantsFile.load(d / "t.toml"), lambda: tenants.add_tenant(d / "u.toml", "admin"),
             lambda: tenants.load_assertion_key(d / "k"), lambda: tenants.mint(b"k" * 64, "admin", 10**9)):
    try:
        call()
    except tenants.TenantsError:
        continue
    sys.exit("accepted under -O")
"""


def test_the_tenant_checks_hold_under_python_O():
    """With `assert`, python -O loaded a tenant named "admin" (operator rights)."""
    r = subprocess.run(
        [sys.executable, "-O", "-c", LOADERS_UNDER_O],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_missing_assertion_key_file_says_how_to_make_one(tmp_path):
    with pytest.raises(tenants.TenantsError, match="new-key"):
        tenants.load_assertion_key(tmp_path / "absent.key")


def test_cli_errors_are_one_line_not_a_traceback(tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "glm53_serving.tenants", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    (tmp_path / "k").write_text("k" * 64)
    for args, words in (
        (("add", str(tmp_path / "t.toml"), "admin"), "reserved"),
        (("admin-token", str(tmp_path / "absent.key")), "new-key"),
        (("admin-token", str(tmp_path / "k"), "--ttl-s", str(10 * 365 * 86400)), "lives 1 to 43200 s"),
        (("new-key", str(tmp_path / "k")), "never overwritten"),
    ):
        r = cli(*args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert (tmp_path / "k").read_text() == "k" * 64


def claims(**over):
    now = int(time.time())
    return {"sub": "acme", "aud": tenants.audience(), "iat": now, "exp": now + 60, "jti": "j1", **over}


def test_assertion_round_trip_and_rejections():
    token = tenants.mint(KEY, "acme")
    p = tenants.verify(KEY, f"Bearer {token}")
    assert p.tenant == "acme" and p.jti and not p.is_admin
    assert tenants.verify(KEY, f"Bearer {tenants.mint(KEY, tenants.ADMIN, 3600)}").is_admin
    assert tenants.verify(KEY, f"Bearer {jwt.encode(claims(), KEY, 'HS256')}").tenant == "acme"  # the control
    assert tenants.verify(b"x" * 64, f"Bearer {token}") is None  # another deployment's key
    now = int(time.time())
    forged = {
        "expired": claims(iat=now - 600, exp=now - 60),
        "wrong_aud": claims(aud="other"),
        "other_deployment": claims(aud=tenants.audience("staging")),
        "no_exp": claims(exp=None),
        "no_jti": claims(jti=None),
        "ten_year_tenant": claims(exp=now + 10 * 365 * 86400),
        "eleven_minute_tenant": claims(exp=now + 660),
        "ten_year_admin": claims(sub=tenants.ADMIN, exp=now + 10 * 365 * 86400),
        "future_iat": claims(iat=now + 3600, exp=now + 3660),
        "internal": claims(sub=tenants.INTERNAL),
        "not_an_id": claims(sub="a b"),
        "int_sub": claims(sub=7),
    }
    for name, c in forged.items():
        token_ = jwt.encode({k: v for k, v in c.items() if v is not None}, KEY, "HS256")
        assert tenants.verify(KEY, f"Bearer {token_}") is None, name
    unsigned = jwt.encode(claims(), None, "none")
    for bad in (unsigned, token + "x", "", "garbage"):
        assert tenants.verify(KEY, f"Bearer {bad}") is None, bad
    assert tenants.verify(KEY, None) is None and tenants.verify(KEY, token) is None  # no "Bearer "


def test_lifetimes_are_bounded_when_minting():
    for tenant, ttl in (("acme", tenants.MAX_TTL_S["tenant"] + 1), (tenants.ADMIN, 10 * 365 * 86400), ("acme", 0)):
        with pytest.raises(tenants.TenantsError, match="lives 1 to"):
            tenants.mint(KEY, tenant, ttl)


def test_the_audience_is_the_deployments(monkeypatch):
    monkeypatch.setenv("GLM53_DEPLOYMENT", "prod-eu")
    token = tenants.mint(KEY, "acme")
    assert tenants.verify(KEY, f"Bearer {token}").tenant == "acme"
    monkeypatch.setenv("GLM53_DEPLOYMENT", "staging")
    assert tenants.verify(KEY, f"Bearer {token}") is None
    assert tenants.verify(KEY, f"Bearer {tenants.mint(KEY, 'acme', deployment='staging')}").tenant == "acme"


def test_the_gateway_reuses_an_assertion_for_half_its_life():
    cache = tenants.AssertionCache(KEY, ttl_s=120)
    h1, h2 = cache.header("acme"), cache.header("acme")
    assert h1 == h2 and h1 != cache.header("beta")
    assert tenants.verify(KEY, h1).tenant == "acme"


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_cache_namespaces_are_distinct_per_tenant_and_keyed(a, b):
    assert (tenants.cache_salt(KEY, a) == tenants.cache_salt(KEY, b)) == (a == b)
    assert tenants.cache_salt(KEY, a) != tenants.cache_salt(b"y" * 64, a)


def _all_routes(app):
    """Every (path, methods) the app serves, included routers flattened."""
    out = []
    for r in app.routes:
        inner = getattr(getattr(r, "original_router", None), "routes", None)
        out += _all_routes(type("R", (), {"routes": inner})) if inner is not None else [getattr(r, "path", None)]
    return out


def test_every_route_of_the_pinned_sglang_is_classified():
    """A new upstream endpoint fails this test until someone decides who may call it."""
    from sglang.srt.entrypoints.http_server import app

    paths = set(_all_routes(app))
    assert None not in paths
    unclassified = sorted(p for p in paths if p not in ROUTES)
    assert not unclassified, f"classify these routes in tenant_guard.ROUTES: {unclassified}"


def test_control_endpoints_are_admin_and_unknown_paths_fail_closed():
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel

    for r in app.routes:  # everything upstream itself marks as admin-level is admin here
        if getattr(getattr(r, "endpoint", None), "_auth_level", None) in (
            AuthLevel.ADMIN_OPTIONAL,
            AuthLevel.ADMIN_FORCE,
        ):
            if r.path != "/abort_request":  # tenants may abort their own requests (ownership-checked)
                assert ROUTES[r.path] is Access.ADMIN, r.path
    for p in (
        "/flush_cache",
        "/update_weights_from_disk",
        "/server_info",
        "/pd_role_switch",
        "/new_upstream_thing",
        "/generate/../flush_cache",
    ):
        assert access_of(p) is Access.ADMIN, p
    assert access_of("/v1/responses/resp_123") is Access.ADMIN
    assert access_of("/v1/models/glm53-tiny") is Access.OPEN
    assert access_of("/metrics") is Access.OPEN and access_of("/health") is Access.OPEN


# --- key lifecycle ---------------------------------------------------------------------------


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "glm53_serving.tenants", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


def test_rotate_then_retire_moves_a_tenant_to_a_new_key_without_a_gap(tmp_path):
    f = tmp_path / "t.toml"
    old = cli("add", f, "acme").stdout.strip()
    beta = cli("add", f, "beta").stdout.strip()
    r = cli("rotate", f, "acme")
    new = r.stdout.strip()
    old_id, new_id = tenants.key_id(tenants.hash_key(old)), tenants.key_id(tenants.hash_key(new))
    assert new_id in r.stderr and new not in r.stderr
    t = tenants.TenantsFile.load(f)
    assert t.tenant_of(f"Bearer {old}") == t.tenant_of(f"Bearer {new}") == "acme"  # both, during the move
    listed = cli("list", f).stdout
    assert f"acme\t{old_id} {new_id}" in listed and new not in listed and old not in listed
    assert cli("retire", f, old_id).returncode == 0
    t = tenants.TenantsFile.load(f)
    assert t.tenant_of(f"Bearer {old}") is None and t.tenant_of(f"Bearer {new}") == "acme"
    assert t.tenant_of(f"Bearer {beta}") == "beta"
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    for args, words in (
        (("retire", f, new_id), "last key"),  # never leaves a tenant without a key by accident
        (("retire", f, "0" * 12), "no key with id"),
        (("rotate", f, "gamma"), "no tenant"),
        (("remove", f, "gamma"), "no tenant"),
    ):
        r = cli(*args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert cli("remove", f, "acme").returncode == 0
    assert tenants.TenantsFile.load(f).keys() == {"beta": [tenants.key_id(tenants.hash_key(beta))]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]  # no temporary file left behind


def test_check_validates_and_a_bad_file_is_never_rewritten(tmp_path):
    f = tmp_path / "t.toml"
    cli("add", f, "acme")
    r = cli("check", f)
    assert r.returncode == 0 and "ok, 1 tenants, 1 keys" in r.stdout
    f.write_text('[tenants.admin]\nkey_sha256 = ["' + "0" * 64 + '"]\n')
    r = cli("check", f)
    assert r.returncode == 2 and "reserved" in r.stderr
    before = f.read_bytes()
    for args in (("add", f, "beta"), ("rotate", f, "admin"), ("remove", f, "admin")):
        assert cli(*args).returncode == 2
    assert f.read_bytes() == before


def test_live_tenants_take_a_good_file_and_keep_the_old_one_over_a_bad_one(tmp_path):
    f = tmp_path / "t.toml"
    a = tenants.add_tenant(f, "acme")
    live = tenants.LiveTenants(f)
    assert live.reload() is None  # unchanged
    b = tenants.add_tenant(f, "beta")
    assert live.reload() == "ok" and live.tenant_of(f"Bearer {b}") == "beta"
    f.write_text("[tenants\n")  # an editor's half-saved file
    assert live.reload() == "error" and live.reload() is None  # reported once
    assert live.tenant_of(f"Bearer {a}") == "acme" and live.tenant_of(f"Bearer {b}") == "beta"
    f.unlink()
    assert live.reload() == "error" and live.tenant_of(f"Bearer {a}") == "acme"
    f.write_text(f'[tenants.acme]\nkey_sha256 = ["{tenants.hash_key(a)}"]\n')
    assert live.reload() == "ok" and live.tenant_of(f"Bearer {b}") is None


def test_limits_are_edited_per_tenant_validated_and_cleared(tmp_path):
    f = tmp_path / "t.toml"
    cli("add", f, "acme")
    assert cli("limits", f, "acme", "--concurrent", 4, "--queue-wait-s", 1.5).returncode == 0
    assert cli("limits", f, "acme", "--requests-per-minute", 60).returncode == 0  # merged with the others
    assert tenants.TenantsFile.load(f).limits == {
        "acme": {"concurrent": 4, "queue_wait_s": 1.5, "requests_per_minute": 60}
    }
    assert 'limits {"concurrent": 4' in cli("list", f).stdout
    before = f.read_bytes()
    for args, words in (
        (("limits", f, "acme", "--concurrent", -1), "concurrent must be an integer >= 0"),
        (("limits", f, "beta", "--concurrent", 1), "no tenant"),
    ):
        r = cli(*args)
        assert r.returncode == 2 and words in r.stderr, r.stderr
    assert f.read_bytes() == before
    assert cli("limits", f, "acme", "--clear").returncode == 0
    assert tenants.TenantsFile.load(f).limits == {}
