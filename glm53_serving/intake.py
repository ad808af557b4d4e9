"""Intake: what the HTTP/tokenizer process checks before a request may reach a scheduler.

Invariant: a request reaches a scheduler only with token ids inside the vocabulary, with the PD
routing fields a PD role needs, and within the deployment's length limit (admission.py).
Everything else is a contract 4xx (errors.py) from the HTTP process; no scheduler, and so no
other tenant's request, is ever exposed to it.

Attacks closed (measured on upstream 0.5.23): a negative or out-of-vocabulary id in
`input_ids` kills the server (IndexError in the embedding lookup takes the scheduler down, and
in PD the client hangs); a `/generate` sent straight to a decode server without bootstrap
fields kills the decode server (AttributeError in `_bootstrap_addr`).
"""

from __future__ import annotations

from glm53_serving import admission, env, events, rejection, request_ids, tenant_guard, validation
from glm53_serving.errors import ClientError

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils: decode skips the transfer


def trusted_bootstrap() -> frozenset[tuple[str, int]] | None:
    raw = env.PREFILL_BOOTSTRAP.get()
    if raw is None:
        return None
    return frozenset((h, int(p)) for h, _, p in (e.strip().rpartition(":") for e in raw.split(",") if e.strip()))


def check_pd_routing(
    role: str, bootstrap_host, bootstrap_room, bootstrap_port=None, *, privileged: bool = False
) -> None:
    """A PD role serves only requests its own router paired: bootstrap fields set (upstream
    crashes the decode server without them) and naming one of the deployment's prefill servers.
    The fake bootstrap host (decode skips the transfer and decodes over pages nothing wrote) is
    for the server's own health checks and the operator's KV-hygiene probe (`privileged`)."""
    if role not in ("prefill", "decode"):
        return
    if bootstrap_host is None or bootstrap_room is None:
        raise ClientError(
            "invalid_request_error",
            f"This is a PD {role} server: it serves only requests routed by its deployment "
            "(bootstrap_host and bootstrap_room missing). Send requests to the gateway.",
            param="bootstrap_host",
        )
    if bootstrap_host == FAKE_BOOTSTRAP_HOST:
        if not privileged:
            raise ClientError(
                "permission_denied",
                "The fake bootstrap host is reserved for the server's own health checks.",
                param="bootstrap_host",
            )
        return
    trusted = trusted_bootstrap()
    if trusted is None or (str(bootstrap_host), int(bootstrap_port or 0)) not in trusted:
        raise ClientError(
            "permission_denied",
            f"{bootstrap_host}:{bootstrap_port} is not a prefill server of this deployment.",
            param="bootstrap_host",
        )


def _privileged() -> bool:
    """The worker's own health check, or the operator."""
    p = tenant_guard.current()
    if p is not None:
        return p.is_admin
    return rejection.current_path() in ("/health", "/health_generate")


def validate_request_hook(self, obj, input_ids, *args, **kwargs):
    """BEFORE TokenizerManager._validate_one_request: runs after tokenization, before the
    request is sent to the scheduler."""
    limits = admission.current_limits()
    try:
        if limits is None:  # cannot happen after start-up (startup.py sets it); fail closed anyway
            raise ClientError("internal_error", "This server's admission limits are not set; it refuses every request.")
        endpoint = rejection.current_path()
        param = validation.prompt_param(endpoint, getattr(obj, "input_ids", None) is not None)
        validation.check_token_ids(input_ids, self.model_config.vocab_size, param)
        validation.check_tokenized(
            input_ids, getattr(obj, "top_logprobs_num", None), self.model_config.vocab_size, endpoint, param
        )
        params = getattr(obj, "sampling_params", None)
        if not isinstance(params, dict):  # embedding requests: prompt bound only
            params = {}
        requested = params.get("max_new_tokens")
        # Length before routing: a request too long for the deployment is answered as such on
        # every role, whichever way it arrived.
        allowed = admission.check(
            limits,
            len(input_ids) if input_ids is not None else 0,
            requested,
            clip=admission.clip_output(),
            prompt_param=param,
        )
        if hasattr(obj, "bootstrap_host"):  # generation requests (embeddings carry no routing)
            check_pd_routing(
                env.role(), obj.bootstrap_host, obj.bootstrap_room, obj.bootstrap_port, privileged=_privileged()
            )
            tenant_guard.namespace_request(obj)
    except ClientError as e:
        rejection.reject(e, detail=f"{e.code} ({e.param})" if e.param else None)
        raise
    # A session turn without max_new_tokens gets its budget in the scheduler, which knows the
    # session's history (admission.session_turn_hook); here only the new input is known.
    if requested is None and tenant_guard.session_of(obj) is not None:
        params["max_new_tokens"] = None  # explicitly: SGLang's default would be 128
    elif allowed != requested:
        params["max_new_tokens"] = allowed
    p = tenant_guard.current()
    events.record(
        "admitted",
        rid=getattr(obj, "rid", None),
        request_id=rejection.current_request_id(),
        tenant=p.tenant if p is not None else None,
        role=env.role(),
        endpoint=rejection.endpoint_label(rejection.current_path()),
    )
    return None


def take_request_id_hook(self, obj, request=None, *args, **kwargs):
    """BEFORE TokenizerManager.generate_request: a request whose body names no `rid` is served
    under the `x-request-id` it came with (the gateway's trace id, which sglang-router forwards to
    prefill and decode alike), so one id names it in the gateway's audit, SGLang's logs and ours,
    and the worker event logs (request_ids.py). SGLang suffixes it per sub-request of a batch."""
    if request is not None and getattr(obj, "rid", "set") is None:
        rid = request_ids.sane(request.headers.get(request_ids.HEADER))
        if rid is not None:
            obj.rid = rid
    return None
