"""The bench's start-up: a launcher that fails says why, and the bench starts it once more."""

import types

import pytest

import glm53_serving.bench.__main__ as bench_main
from glm53_serving.bench.serving import LaunchFailed, start


def test_a_failed_launcher_is_reported_with_its_own_last_lines(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('topology = "pd"\n[model]\npreset = "no-such-preset"\n')
    with pytest.raises(LaunchFailed) as failed:
        start(tmp_path / "run", "--config", str(bad))
    message = str(failed.value)
    # the launcher's own words, which the bench used to send to /dev/null
    assert "launcher failed (exit 2)" in message and "model.preset must be one of" in message, message


def _fake_start(fail: dict):
    calls = []

    def fake(run_dir, *args, env=None):
        calls.append(run_dir.name)
        if fail.get(run_dir.name, 0) > 0:
            fail[run_dir.name] -= 1
            raise LaunchFailed(f"launcher failed (exit 1): see {run_dir}")
        return types.SimpleNamespace(name=run_dir.name), {"run": run_dir.name}

    return fake, calls


def test_a_deployment_whose_launcher_failed_is_started_once_more(tmp_path, monkeypatch, capsys):
    fake, calls = _fake_start({"pd-on": 1})
    stopped = []
    monkeypatch.setattr(bench_main, "start", fake)
    monkeypatch.setattr(bench_main, "stop", lambda proc: stopped.append(proc.name))
    a = types.SimpleNamespace(config="cpu.toml")
    up = bench_main.deploy(tmp_path, a, ["single", "pd"])
    assert {k: v[1]["run"] for k, v in up.items()} == {
        ("single", "on"): "single-on",
        ("single", "off"): "single-off",
        ("pd", "on"): "pd-on-retry1",
        ("pd", "off"): "pd-off",
    }
    assert sorted(calls) == sorted(["single-on", "single-off", "pd-on", "pd-off", "pd-on-retry1"]) and not stopped
    assert "pd-on: launcher failed" in capsys.readouterr().err


def test_a_second_failure_ends_the_run_and_stops_what_came_up(tmp_path, monkeypatch):
    fake, calls = _fake_start({"pd-on": 1, "pd-on-retry1": 1})
    stopped = []
    monkeypatch.setattr(bench_main, "start", fake)
    monkeypatch.setattr(bench_main, "stop", lambda proc: stopped.append(proc.name))
    with pytest.raises(LaunchFailed, match="pd-on-retry1"):
        bench_main.deploy(tmp_path, types.SimpleNamespace(config="cpu.toml"), ["single", "pd"])
    assert sorted(stopped) == ["pd-off", "single-off", "single-on"]


@pytest.mark.parametrize("own_core", [True, False])
def test_with_gateway_own_core_every_gateway_and_only_they_run_on_the_last_core(tmp_path, monkeypatch, own_core):
    """A GPU host's layout: the gateways' CPU is not taken from the servers' (the rest of the
    deployment, started after the bench pins itself, inherits the other cores)."""
    pinned, mine = {}, []
    monkeypatch.setattr(bench_main.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(bench_main.os, "sched_setaffinity", lambda pid, cores: mine.append(set(cores)))
    up = {
        (t, side): (None, {"processes": [{"name": "gateway", "pid": f"{t}-{side}"}]})
        for t in ("single", "pd")
        for side in ("on", "off")
    }
    monkeypatch.setattr(bench_main, "deploy", lambda tmp, a, group: {k: up[k] for k in up if k[0] in group})
    monkeypatch.setattr(bench_main, "pin", lambda pid, cores: pinned.__setitem__(pid, set(cores)))
    monkeypatch.setattr(bench_main, "process", lambda info, name: info["processes"][0])
    monkeypatch.setattr(bench_main, "run_topology", lambda tmp, a, t, up: [t])
    monkeypatch.setattr(bench_main, "stop_all", lambda up: None)
    a = types.SimpleNamespace(quick=False, topologies=["single", "pd"], gateway_own_core=own_core)
    assert bench_main.run(tmp_path, a) == ["single", "pd"]
    if own_core:
        assert mine == [{0, 1}]
        assert pinned == {f"{t}-{side}": {2} for t in ("single", "pd") for side in ("on", "off")}
    else:
        assert mine == [] and pinned == {}  # nothing pinned: the bench keeps its affinity


def test_gateway_own_core_on_one_core_is_refused(monkeypatch):
    monkeypatch.setattr(bench_main.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit, match="2 or more cores"):
        bench_main.own_core_split()
