"""The admission formula (docs/admission.md) and the check, as pure functions, by property."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm53_serving.admission import NO_TOTAL_BOUND, Capacity, Limits, check
from glm53_serving.errors import ClientError

ctx_s = st.integers(16, 1 << 21)
kv_s = st.integers(16, 1 << 22)
page_s = st.sampled_from([1, 16, 64])


@st.composite
def deployments(draw):
    ctx = draw(ctx_s)
    single = draw(st.booleans())
    if single:
        caps = [Capacity("single", ctx, draw(kv_s), draw(page_s))]
    else:
        page = draw(page_s)
        caps = [
            Capacity("prefill", ctx, draw(kv_s), page),
            Capacity("decode", ctx, draw(kv_s), page, draw(st.integers(0, 1024))),
        ]
    if all(c.max_input_tokens > 0 for c in caps):
        return caps
    return draw(deployments())


def documented(caps, prompt, max_new):
    """docs/admission.md, written out independently of admission.py."""
    input_limit, total_limit = [], []
    for c in caps:
        i = min(c.context_length - 1, c.kv_tokens - 1) - 5
        if c.role == "decode":
            i = min(i, c.kv_tokens - c.decode_reserve)
        input_limit.append(i)
        if c.role != "prefill":
            total_limit.append(min(c.context_length, c.kv_tokens) - 2 * c.page_size)
    ok = prompt < min(input_limit)
    if max_new is not None and total_limit:
        ok = ok and prompt + max_new <= min(total_limit)
    return ok


@settings(max_examples=500, deadline=None)
@given(deployments(), st.data())
def test_accepts_exactly_when_the_documented_formula_says_so(caps, data):
    limits = Limits.of(caps)
    # Draw around the boundaries, where off-by-one errors live.
    prompt = data.draw(
        st.one_of(st.integers(0, 1 << 22), st.integers(limits.max_input_tokens - 2, limits.max_input_tokens + 1))
    )
    max_new = data.draw(
        st.one_of(
            st.none(),
            st.integers(0, 1 << 22),
            st.integers(max(0, limits.max_total_tokens - prompt - 1), max(0, limits.max_total_tokens - prompt + 1)),
        )
    )
    try:
        check(limits, prompt, max_new)
        accepted = True
    except ClientError as e:
        accepted = False
        assert e.status == 400 and e.code == "context_length_exceeded"
        assert e.body()["error"]["prompt_tokens"] == prompt
    assert accepted == documented(caps, prompt, max_new)


@settings(max_examples=200, deadline=None)
@given(deployments(), st.data())
def test_the_deployment_limit_is_within_every_role(caps, data):
    limits = Limits.of(caps)
    for c in caps:
        assert limits.within(Limits.of([c]))


def test_at_the_limit_rejected_one_below_accepted():
    limits = Limits.of([Capacity("single", 512, 2048)])
    assert limits.max_input_tokens == 506
    with pytest.raises(ClientError):
        check(limits, 506, 1)
    assert check(limits, 505, 1) == 1


def test_clipping_is_opt_in_and_exact():
    limits = Limits.of([Capacity("single", 512, 2048)])
    with pytest.raises(ClientError) as e:
        check(limits, 100, 500)
    assert e.value.param == "max_tokens" and e.value.details["max_total_tokens"] == 510
    assert check(limits, 100, 500, clip=True) == 410


def test_prefill_alone_bounds_only_the_prompt():
    assert Capacity("prefill", 512, 2048).max_total_tokens == NO_TOTAL_BOUND


def test_error_body_has_the_openai_shape_and_the_numbers():
    with pytest.raises(ClientError) as e:
        check(Limits(10, 20, 32), 12, 3)
    err = e.value.body()["error"]
    assert (
        err["type"] == "invalid_request_error"
        and err["code"] == "context_length_exceeded"
        and err["param"] == "messages"
    )
    assert (err["prompt_tokens"], err["max_new_tokens"], err["max_input_tokens"], err["max_total_tokens"]) == (
        12,
        3,
        10,
        20,
    )
    assert isinstance(err["message"], str) and "12" in err["message"]


def test_capacity_problems_name_every_unsafe_configuration():
    from glm53_serving.startup import capacity_problems

    incident = Capacity("prefill", 1048576, 681280)
    (msg, *_rest) = capacity_problems(incident, Limits(100, 200, 1048576), auto_truncate=False)
    assert "1048576" in msg and "681280" in msg and "enlarge the pool" in msg and "--context-length 681280" in msg
    ok = Capacity("decode", 512, 2048, decode_reserve=64)
    assert capacity_problems(ok, Limits.of([ok]), auto_truncate=False) == []
    assert any("auto-truncate" in p for p in capacity_problems(ok, Limits.of([ok]), auto_truncate=True))
    assert any("needs the deployment's limits" in p for p in capacity_problems(ok, None, auto_truncate=False))
    assert capacity_problems(Capacity("single", 512, 2048), None, auto_truncate=True) == []  # single may truncate
    too_small = Capacity("decode", 512, 400, decode_reserve=64)
    assert any("less than the deployment's limits" in p for p in capacity_problems(too_small, Limits.of([ok]), False))
