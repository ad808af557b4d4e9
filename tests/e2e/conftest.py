import pytest

from tests.e2e.launcher import alive, launch


def _topology(tmp_path_factory, name):
    run = launch(tmp_path_factory.mktemp(f"run-{name}"), "--topology", name)
    yield run
    run.stop()
    leftover = alive(run.info["all_pids"])
    assert not leftover, f"processes left after stopping the {name} topology: {leftover}"


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    yield from _topology(tmp_path_factory, "single")


@pytest.fixture(scope="session")
def pd(tmp_path_factory):
    yield from _topology(tmp_path_factory, "pd")
