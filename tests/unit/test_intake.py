"""Intake checks as pure functions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53_serving.errors import ClientError
from glm53_serving.intake import check_pd_routing, check_token_ids


@given(st.lists(st.integers(-2**40, 2**40), max_size=50), st.integers(1, 200_000))
def test_token_ids_accepted_exactly_inside_the_vocabulary(ids, vocab):
    inside = all(0 <= i < vocab for i in ids)
    try:
        check_token_ids(ids, vocab)
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
    check_pd_routing(role, "127.0.0.1", 7)


def test_single_server_needs_no_routing_fields():
    check_pd_routing("single", None, None)
