"""Intake checks as pure functions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53_serving.env import PREFILL_BOOTSTRAP
from glm53_serving.errors import ClientError
from glm53_serving.intake import FAKE_BOOTSTRAP_HOST, check_pd_routing
from glm53_serving.validation import check_token_ids


@given(st.lists(st.integers(-(2**40), 2**40), max_size=50), st.integers(1, 200_000))
def test_token_ids_accepted_exactly_inside_the_vocabulary(ids, vocab):
    inside = all(0 <= i < vocab for i in ids)
    try:
        check_token_ids(ids, vocab, "input_ids")
        assert inside
    except ClientError as e:
        assert not inside and e.status == 400 and e.param == "input_ids"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_need_routing_fields(role):
    with pytest.raises(ClientError) as e:
        check_pd_routing(role, None, None)
    assert e.value.param == "bootstrap_host" and e.value.status == 400
    with pytest.raises(ClientError):
        check_pd_routing(role, "127.0.0.1", None)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_take_only_the_deployments_prefill_endpoints(role, monkeypatch):
    monkeypatch.setenv(PREFILL_BOOTSTRAP.name, "127.0.0.1:8998, 10.0.0.2:9000")
    check_pd_routing(role, "127.0.0.1", 7, 8998)
    check_pd_routing(role, "10.0.0.2", 7, 9000)
    for host, port in (("127.0.0.1", 8999), ("10.0.0.3", 9000), ("evil.example", 8998)):
        with pytest.raises(ClientError) as e:
            check_pd_routing(role, host, 7, port)
        assert e.value.status == 403 and e.value.param == "bootstrap_host"
    monkeypatch.delenv(PREFILL_BOOTSTRAP.name)
    with pytest.raises(ClientError):  # no configured endpoints: nothing is trusted
        check_pd_routing(role, "127.0.0.1", 7, 8998)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_fake_bootstrap_host_only_for_privileged_requests(role):
    with pytest.raises(ClientError) as e:
        check_pd_routing(role, FAKE_BOOTSTRAP_HOST, 0, 8998)
    assert e.value.status == 403
    check_pd_routing(role, FAKE_BOOTSTRAP_HOST, 0, 8998, privileged=True)


def test_fake_bootstrap_host_matches_upstream():
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST as upstream

    assert FAKE_BOOTSTRAP_HOST == upstream


def test_single_server_needs_no_routing_fields():
    check_pd_routing("single", None, None)
