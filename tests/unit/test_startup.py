"""The start-up handshake's HTTP half and the intake hook, as functions: what refuses to start,
what the status says, and the intake's fail-closed branch."""

from types import SimpleNamespace

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from glm53_serving import admission, env, front_door, intake, plugin, rejection, startup, tenant_guard
from glm53_serving.admission import Capacity, Limits
from glm53_serving.errors import ClientError


def stamped(role: str) -> dict:
    return {
        startup.STATUS_KEY: {
            "active": True,
            "capacity": Capacity(role, 512, 2048).__dict__
            if False
            else {"role": role, "context_length": 512, "kv_tokens": 2048, "page_size": 1, "decode_reserve": 0},
        }
    }


@pytest.fixture
def http_process(monkeypatch):
    """An HTTP process whose own hooks are in place (what plugin.problems and the front door check
    in a server), so that the handshake's own decisions are what is tested."""
    monkeypatch.setattr(plugin, "problems", lambda process: [])
    monkeypatch.setattr(plugin, "guards_active", lambda: True)
    monkeypatch.setattr(front_door, "problems", lambda app=None: [])
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: SimpleNamespace())
    monkeypatch.delenv(env.DEPLOYMENT_LIMITS.name, raising=False)
    monkeypatch.setattr(admission, "_limits", None)


def test_a_process_whose_plugin_never_registered_refuses():
    with pytest.raises(startup.RefuseToStart, match="never ran"):
        startup.require_verified_schedulers([stamped("single")])


def test_a_scheduler_that_did_not_run_the_check_refuses_the_server(http_process):
    with pytest.raises(startup.RefuseToStart, match="scheduler 1 did not run"):
        startup.require_verified_schedulers([stamped("single"), {}])


def test_a_pd_server_without_the_deployments_prefill_endpoints_refuses(http_process, monkeypatch):
    monkeypatch.delenv(env.PREFILL_BOOTSTRAP.name, raising=False)
    with pytest.raises(startup.RefuseToStart, match=env.PREFILL_BOOTSTRAP.name):
        startup.require_verified_schedulers([stamped("decode")])


def test_uncovered_flags_refuse(http_process, monkeypatch):
    monkeypatch.setattr("sglang.srt.runtime_context.get_server_args", lambda: SimpleNamespace(tokenizer_worker_num=2))
    with pytest.raises(startup.RefuseToStart, match="--tokenizer-worker-num 2 is refused"):
        startup.require_verified_schedulers([stamped("single")])


def test_a_verified_server_sets_its_limits_and_reports_them(http_process, monkeypatch):
    monkeypatch.setenv(env.PREFILL_BOOTSTRAP.name, "127.0.0.1:9000")
    infos = startup.require_verified_schedulers([stamped("decode")])
    want = Limits.of([Capacity("decode", 512, 2048)])
    assert admission.current_limits() == want
    status = infos[0][startup.STATUS_KEY]
    assert status["limits"]["max_input_tokens"] == want.max_input_tokens
    assert status["tenants"] == ("enforced" if tenant_guard.enforced() else "off")


# --- the intake hook ----------------------------------------------------------------------------


@pytest.fixture
def tokenizer_manager(monkeypatch):
    monkeypatch.setattr(env, "role", lambda: "single")
    monkeypatch.setattr(tenant_guard, "_tenants_on", False)
    return SimpleNamespace(model_config=SimpleNamespace(vocab_size=512))


def intake_of(tm, obj, ids, path="/generate"):
    slot, token = rejection.open_slot(path)
    try:
        intake.validate_request_hook(tm, obj, ids)
    finally:
        rejection.close_slot(token)
    return slot


def test_without_limits_intake_refuses_every_request(tokenizer_manager, monkeypatch):
    """Cannot happen after start-up; if it did, nothing may reach a scheduler unchecked."""
    monkeypatch.setattr(admission, "_limits", None)
    with pytest.raises(ClientError) as e:
        intake_of(tokenizer_manager, GenerateReqInput(input_ids=[5, 6]), [5, 6])
    assert e.value.code == "internal_error" and e.value.status == 500


def test_intake_names_the_field_the_prompt_came_in(tokenizer_manager, monkeypatch):
    monkeypatch.setattr(admission, "_limits", Limits(10, 20, 32))
    for obj, path, param in (
        (GenerateReqInput(input_ids=[5] * 12), "/generate", "input_ids"),
        (GenerateReqInput(text="x"), "/generate", "text"),
        (GenerateReqInput(text="x"), "/v1/completions", "prompt"),
        (GenerateReqInput(text="x"), "/v1/chat/completions", "messages"),
    ):
        with pytest.raises(ClientError) as e:
            intake_of(tokenizer_manager, obj, [5] * 12, path)
        assert e.value.code == "context_length_exceeded" and e.value.param == param, (path, e.value.param)


def test_intake_records_the_rejection_for_the_hard_4xx_and_clips_only_when_told(tokenizer_manager, monkeypatch):
    monkeypatch.setattr(admission, "_limits", Limits(10, 20, 32))
    slot, token = rejection.open_slot("/generate")
    try:
        with pytest.raises(ClientError):
            intake.validate_request_hook(tokenizer_manager, GenerateReqInput(input_ids=[600]), [600])
    finally:
        rejection.close_slot(token)
    assert slot.rejection is not None and slot.rejection.param == "input_ids"  # out of the vocabulary
    monkeypatch.setenv(env.CLIP_OUTPUT.name, "1")
    obj = GenerateReqInput(input_ids=[5] * 5, sampling_params={"max_new_tokens": 100})
    intake_of(tokenizer_manager, obj, [5] * 5)
    assert obj.sampling_params["max_new_tokens"] == 15
