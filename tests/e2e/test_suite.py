"""The isolation suite's ci profile against real topologies (single, then PD, launched by the
suite through the launcher), and proof that it bites: with the incident reintroduced (KV guards
off and a stale-row read of another tenant's KV) it reports leaks through two independent
oracles, and its fault was confirmed to have fired."""

import re
import sys
from pathlib import Path

import pytest

from glm53_serving.suite.faults import FAULTS
from tests.e2e.launcher import run_whole

pytestmark = pytest.mark.e2e

SUMMARY = re.compile(
    r"^suite: requests=(\d+) tenants=(\d+) interleavings=(\d+) faults=(\d+)/(\d+) confirmed leaks=(\d+) "
    r"oracles_fired=(\d+)$"
)


def suite(tmp_path, *args, timeout=1500, env=None):
    p = run_whole(
        [sys.executable, "-m", "glm53_serving.suite", "--out", str(tmp_path / "out"), *args], timeout=timeout, env=env
    )
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    m = SUMMARY.match(last)
    assert m, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    return p, [int(x) for x in m.groups()]


def test_the_ci_profile_finds_nothing_on_single_and_pd(tmp_path):
    p, (requests, tenants, interleavings, injected, confirmed, leaks, fired) = suite(tmp_path, "--profile", "ci")
    assert p.returncode == 0 and leaks == 0 and fired == 0, p.stderr[-4000:]
    assert requests >= 400 and tenants >= 4 and interleavings >= 16, p.stderr[-2000:]
    # session continuations on single (SGLang's sessions: turn 2 judged as history + its input)
    assert re.search(r"suite \[single\] interleaving \d+: \d+ calls \(\d+ continue a session\)", p.stderr)
    (steps,) = re.findall(r"suite \[allocator\]: (\d+) state-machine steps", p.stderr)
    assert int(steps) >= 10_000, steps
    # every fault injected into PD fired (process state, restart, harness log, the slow client's
    # clock) and was judged: no finding above
    assert injected == confirmed == len(FAULTS), (injected, confirmed)
    for f in FAULTS:
        assert f"suite [fault {f.name}]: confirmed=True" in p.stderr, p.stderr[-4000:]


def test_62_calls_at_once_on_the_dsa_model_each_answer_as_they_do_alone(tmp_path):
    """The thorough run's differential finding (docs/suite-traces/thorough-2026-12-07.json): one
    call of 62 differed from its solo run at token 35 while MKL's matmul rows moved with the batch.
    The suite's servers compute batch-invariantly (GLM53_BATCH_INVARIANT), and the same 62 calls
    replayed match their solo runs token for token."""
    trace = Path(__file__).resolve().parents[2] / "docs" / "suite-traces" / "thorough-2026-12-07.json"
    p, (requests, _, _, _, _, leaks, fired) = suite(
        tmp_path, "--profile", "thorough", "--topology", "single", "--replay", str(trace)
    )
    assert p.returncode == 0 and leaks == 0 and fired == 0, p.stderr[-4000:]
    assert requests == 62 and "suite [single]: batch-invariant workers: 1/1" in p.stderr, p.stderr[-2000:]
    assert re.search(r"interleaving 0: 62 calls: \{'200': 4\d", p.stderr), p.stderr[-2000:]


def test_a_transfer_that_dropped_pages_without_decodes_check_is_a_finding(tmp_path):
    """The fault oracle bites: with decode's handoff check off, the call whose latent pages never
    arrived is served a 200 (from zeroed KV), and the suite says so and fails."""
    p, (_, _, _, injected, confirmed, leaks, fired) = suite(
        tmp_path,
        "--topology",
        "pd",
        "--interleavings",
        "1",
        "--fault",
        "transfer-drops-latent",
        env={"GLM53_KV_GUARD_OFF": "handoff"},
    )
    assert p.returncode == 1 and injected == confirmed == 1 and fired >= 1, p.stderr[-4000:]
    assert "[transfer-drops-latent] transfer-drops-latent: the call whose pages never arrived got a 200" in p.stderr


def test_the_reintroduced_incident_is_caught_by_two_oracles(tmp_path):
    p, (requests, _, _, injected, confirmed, leaks, fired) = suite(
        tmp_path, "--profile", "ci", "--topology", "single", "--interleavings", "1", "--reintroduce-incident"
    )
    assert p.returncode == 1 and leaks > 0 and fired >= 2, p.stderr[-4000:]
    assert injected >= 1 and confirmed == injected, (injected, confirmed)
    incident = [line for line in p.stderr.splitlines() if "suite-incident" in line or "differs from its solo" in line]
    assert any("[differential]" in line for line in incident), p.stderr[-4000:]
    assert any("[canary]" in line and "reached KV another tenant wrote" in line for line in incident)
    # the failing interleaving was saved, and replays with one command
    assert list((tmp_path / "out").glob("failure-single-*.json"))


def test_the_suite_takes_a_running_deployment_by_url(tmp_path, single):
    """--url: a deployment the suite did not launch (the session's single server, its two demo
    tenants), with its worker for the drain oracle; no KV-level canary there."""
    t = single.info["tenants"]
    p, (requests, tenants, interleavings, _, _, leaks, fired) = suite(
        tmp_path,
        "--url",
        single.url,
        "--keys",
        t["demo_keys_file"],
        "--worker",
        f"server={single.worker('server')}",
        "--assertion-key",
        t["assertion_key_file"],
        "--deployment",
        t["deployment"],
        "--interleavings",
        "2",
    )
    assert p.returncode == 0 and leaks == 0 and fired == 0, p.stderr[-4000:]
    assert tenants == 2 and interleavings == 2 and requests >= 50
    assert "suite [url] interleaving 1" in p.stderr
