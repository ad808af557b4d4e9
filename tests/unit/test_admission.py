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
    if min(c.max_input_tokens for c in caps) > 1:
        return caps
    return draw(deployments())


def documented(caps, prompt, max_new):
    """docs/admission.md, written out independently of admission.py."""
    input_limit, total_limit = [], []
    for c in caps:
        i = min(c.context_length - 1, c.kv_tokens - 1) - 5
        if c.role == "decode":
            i = min(i, c.kv_tokens - c.decode_reserve)
        if c.role != "prefill":
            total = min(c.context_length, c.kv_tokens) - 2 * c.page_size
            total_limit.append(total)
            i = min(i, total)  # room for one output token
        input_limit.append(i)
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
        check(Limits(10, 20, 32), 12, 3, prompt_param="messages")
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
    # Data-parallel schedulers admit session turns by their own pools: only with the deployment's
    # limits do they admit by what the server advertises (the smallest of them).
    single = Capacity("single", 512, 2048)
    (dp,) = capacity_problems(single, None, auto_truncate=False, dp_ranks=2)
    assert "2 data-parallel schedulers" in dp and "GLM53_DEPLOYMENT_LIMITS" in dp
    assert capacity_problems(single, Limits.of([single]), auto_truncate=False, dp_ranks=2) == []
    too_small = Capacity("decode", 512, 400, decode_reserve=64)
    assert any("less than the deployment's limits" in p for p in capacity_problems(too_small, Limits.of([ok]), False))
    # A window that differs either way: a larger one would accept what prefill refuses, and back.
    for ctx in (256, 1024):
        other = Capacity("decode", ctx, 2048, decode_reserve=64)
        (msg,) = [p for p in capacity_problems(other, Limits.of([ok]), False) if "context window" in p]
        assert f"({ctx} tokens) differs from the deployment's (512 tokens" in msg and "--context-length 512" in msg


@settings(max_examples=1000, deadline=None)
@given(deployments(), st.data())
def test_an_admitted_prompt_always_has_room_for_output_and_clip_never_goes_below_one(caps, data):
    """With pages >= 4 the total bound falls below SGLang's input bound; a prompt between the two
    was admitted with no room for output (clip mode gave it max_new_tokens -28). Now: an admitted
    prompt takes `null` exactly when it takes 1 and 0, clip gives at least one token, and whatever is
    admitted fits the total."""
    limits = Limits.of(caps)
    assert limits.max_prompt_tokens + 1 <= limits.max_total_tokens and limits.max_model_len <= limits.context_length
    prompt = data.draw(st.one_of(st.integers(0, limits.max_input_tokens + 2), st.integers(0, 1 << 22)))
    requested = data.draw(st.one_of(st.none(), st.integers(0, 1 << 22)))

    def admitted(max_new, clip=False):
        try:
            return True, check(limits, prompt, max_new, clip=clip)
        except ClientError as e:
            assert e.code == "context_length_exceeded"
            return False, None

    takes_null, filled = admitted(None)
    assert takes_null == admitted(0)[0] == admitted(1)[0] == (prompt < limits.max_input_tokens)
    if takes_null:  # filled in with exactly what is served: SGLang alone would go to the window
        assert filled == limits.max_total_tokens - prompt >= 1
    ok, allowed = admitted(requested, clip=True)
    assert ok == takes_null
    if ok and requested is not None:
        assert allowed == min(requested, limits.max_total_tokens - prompt)
        assert allowed >= min(requested, 1) and prompt + allowed <= limits.max_total_tokens


def test_the_incident_case_of_a_page_size_64_total_below_the_input_bound():
    limits = Limits.of([Capacity("single", 10_000, 10_000, page_size=64)])
    assert limits.max_total_tokens == 10_000 - 128 and limits.max_input_tokens == limits.max_total_tokens
    assert check(limits, limits.max_prompt_tokens, 1, clip=True) == 1
    with pytest.raises(ClientError):
        check(limits, 9_900, 1, clip=True)  # was admitted with max_new_tokens -28


def test_the_advertised_window_is_the_served_one_with_a_clamped_small_decode_pool():
    """clamp_context_to_kv with a 400-token decode pool under a 512 window advertised 400 and
    refused every prompt over 335: the advertisement is now exactly what is served."""
    ctx = 400  # clamped to the smallest pool
    limits = Limits.of([Capacity("prefill", ctx, 2048), Capacity("decode", ctx, 400, 1, 64)])
    assert (limits.max_model_len, limits.max_prompt_tokens) == (398, 335)
    assert check(limits, 335, 398 - 335) == 398 - 335 and check(limits, 1, 397) == 397
    for prompt, max_new in ((336, 1), (335, 398 - 335 + 1), (1, 398)):
        with pytest.raises(ClientError):
            check(limits, prompt, max_new)


# --- the output limit (GLM-5.3: 128K output tokens per request) ----------------------------------


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(1, 600), prompt=st.integers(0, 505), asked=st.one_of(st.none(), st.integers(1, 800)))
def test_an_output_limit_bounds_every_request_and_fills_in_an_unset_max_tokens(cap, prompt, asked):
    limits = Limits(506, 510, 512, max_output_tokens=cap)
    budget = 510 - prompt
    try:
        allowed = check(limits, prompt, asked)
    except ClientError as e:
        over_cap = asked is not None and asked > cap
        assert e.code == ("max_tokens_exceeded" if over_cap else "context_length_exceeded"), e.code
        assert e.param == "max_tokens" and (not over_cap or e.details["max_output_tokens"] == cap)
        assert asked is not None and (asked > cap or asked > budget)
        return
    assert allowed == (min(cap, budget) if asked is None else asked) and allowed <= cap


def test_over_the_output_limit_is_clipped_to_it_in_clip_mode():
    limits = Limits(506, 510, 512, max_output_tokens=100)
    assert check(limits, 10, 101, clip=True) == 100
    assert check(limits, 450, 101, clip=True) == 60  # then to the window's budget
    with pytest.raises(ValueError):
        Limits(506, 510, 512, max_output_tokens=0)
