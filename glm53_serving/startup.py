"""Start-up handshake: a server whose guards are not all in place, or whose configuration could
leak, refuses to start.

Invariant: no SGLang server with this plugin installed reports ready unless
- in the scheduler *and* in the HTTP/tokenizer process every applicable hook of `hooks.HOOKS` is
  in effect (or the guards were switched off explicitly, which is then reported), and
- its KV pool can hold what it advertises (context window <= KV capacity: the incident's
  1,048,576-token window over a 681,280-token pool), and it can serve the deployment's limit.

Two halves, so that neither process can be unprotected silently:
1. each scheduler verifies its own hooks and capacity inside `get_init_info`, raising instead of
   reporting ready (SGLang then takes the whole server down), and stamps its init info with a
   `glm53_serving` status (also shown in /server_info);
2. the HTTP/tokenizer process, when the scheduler infos arrive, verifies its own hooks, refuses
   unless every scheduler stamped its info, and sets the admission limits.
The launcher adds a third check from outside: /server_info must report the plugin active.
"""

from __future__ import annotations

import dataclasses
import logging

from glm53_serving import admission, env, front_door, intake, kv_guard, kv_handoff, plugin, server_flags, tenant_guard
from glm53_serving.admission import Capacity, Limits

logger = logging.getLogger("glm53_serving")

STATUS_KEY = "glm53_serving"


class RefuseToStart(RuntimeError):
    pass


def _refuse(where: str, problems: list[str]) -> RefuseToStart:
    msg = f"glm53_serving: refusing to start ({where}): " + "; ".join(problems)
    logger.error(msg)
    return RefuseToStart(msg)


def capacity_of(scheduler) -> Capacity:
    from sglang.srt.runtime_context import get_disagg

    role = env.role()
    return Capacity(
        role=role,
        context_length=scheduler.model_config.context_len,
        kv_tokens=scheduler.max_total_num_tokens,
        page_size=scheduler.page_size,
        decode_reserve=get_disagg().num_reserved_decode_tokens if role == "decode" else 0,
    )


def capacity_problems(cap: Capacity, deployment: Limits | None, auto_truncate: bool, dp_ranks: int = 1) -> list[str]:
    """Configurations that could leak or hang; pure, so tests can call it without a server.
    `dp_ranks`: the server's data-parallel schedulers (DP or attention-DP), each with its own pool."""
    problems = []
    if cap.context_length > cap.kv_tokens:
        problems.append(
            f"the advertised context window ({cap.context_length} tokens) exceeds this {cap.role} server's KV "
            f"capacity ({cap.kv_tokens} tokens), the incident's configuration. Either enlarge the pool "
            f"(--max-total-tokens / --mem-fraction-static, or more GPUs) or advertise at most the capacity "
            f"(--context-length {cap.kv_tokens}; the launcher does it with [admission] clamp_context_to_kv = true)"
        )
    if cap.role != "single":
        if auto_truncate:
            problems.append(
                "--allow-auto-truncate is refused in PD mode: prefill and decode would truncate "
                "to different lengths and decode would attend over pages nothing wrote"
            )
        if deployment is None:
            problems.append(
                f"a PD {cap.role} server needs the deployment's limits in {env.DEPLOYMENT_LIMITS.name} "
                "(the launcher sets it from every role) so that prefill and decode cannot disagree"
            )
    if deployment is None and dp_ranks > 1:
        # The HTTP process advertises the smallest of its schedulers' limits, but a session turn
        # is admitted in the scheduler that holds the session (admission.session_turn_hook), which
        # knows only its own pool: a larger rank would serve more than /v1/models says.
        problems.append(
            f"a server with {dp_ranks} data-parallel schedulers needs the deployment's limits in "
            f"{env.DEPLOYMENT_LIMITS.name} (the launcher sets it), so that each admits session turns by the "
            "limits the server advertises, not by its own pool's"
        )
    if deployment is not None and cap.context_length != deployment.context_length:
        # Prefill and decode that disagree on the window accept different requests: a public PD
        # benchmark saw 33 of 1,000 requests hang. One window, the deployment's, or no start.
        problems.append(
            f"this {cap.role} server's context window ({cap.context_length} tokens) differs from the "
            f"deployment's ({deployment.context_length} tokens, {env.DEPLOYMENT_LIMITS.name}): every server of a "
            f"deployment must be started with --context-length {deployment.context_length}"
        )
    if deployment is not None and not deployment.within(Limits.of([cap])):
        problems.append(
            f"this {cap.role} server (KV {cap.kv_tokens} tokens, page {cap.page_size}, reserve {cap.decode_reserve}) "
            f"can serve prompts < {cap.max_input_tokens} and totals <= {cap.max_total_tokens}, less than the "
            f"deployment's limits {deployment}: its pool is smaller than the topology declared"
        )
    return problems


def scheduler_verified_info(result: dict, self) -> dict:
    """AFTER Scheduler.get_init_info."""
    from sglang.srt.runtime_context import get_server_args, get_serving

    problems = plugin.problems("scheduler")
    cap = capacity_of(self)
    if plugin.guards_active():
        try:
            deployment = Limits.from_env()
        except (TypeError, ValueError) as e:
            deployment, problems = None, [*problems, f"{env.DEPLOYMENT_LIMITS.name} is malformed: {e}"]
        args = get_server_args()
        dp_ranks = max(getattr(args, "dp_size", 1) or 1, getattr(args, "attn_dp_size", 1) or 1)
        problems += capacity_problems(cap, deployment, bool(get_serving().allow_auto_truncate), dp_ranks)
        admission.set_limits(deployment or Limits.of([cap]))  # for session turns (admission.session_turn_hook)
        problems += kv_guard.allocator_problems(self.token_to_kv_pool_allocator)
        if plugin.kv_part_on("handoff"):
            kv_handoff.attach(self)  # PD prefill counts the zero slots it sends (kv_handoff.py)
        problems += server_flags.problems(get_server_args())
    if problems:
        raise _refuse("scheduler", problems)
    result[STATUS_KEY] = {**plugin.status(), "capacity": dataclasses.asdict(cap), "kv_pool": _pool_name(self)}
    return result


def _pool_name(scheduler) -> str | None:
    """The KV pool class the guards run on (e.g. DSATokenToKVPool), for /server_info."""
    get_kvcache = getattr(scheduler.token_to_kv_pool_allocator, "get_kvcache", None)
    return type(get_kvcache()).__name__ if get_kvcache else None


def require_verified_schedulers(infos: list, scheduler_pipe_readers=None, scheduler_procs=None) -> list:
    """AFTER engine._wait_for_scheduler_ready (runs in the HTTP/tokenizer process)."""
    problems = plugin.problems("http")
    caps = []
    for i, info in enumerate(infos):
        if STATUS_KEY not in info:
            problems.append(f"scheduler {i} did not run glm53_serving's start-up check")
        else:
            caps.append(Capacity(**info[STATUS_KEY]["capacity"]))
    if plugin.guards_active() and not problems:
        from sglang.srt.runtime_context import get_server_args

        problems += front_door.problems()
        problems += server_flags.problems(get_server_args())
        if any(c.role != "single" for c in caps) and intake.trusted_bootstrap() is None:
            problems.append(
                f"a PD server needs its deployment's prefill bootstrap endpoints in "
                f"{env.PREFILL_BOOTSTRAP.name} (the launcher sets it) to refuse foreign handoffs"
            )
        limits = Limits.from_env() or Limits.of(caps)
        admission.set_limits(limits)
        for info in infos:
            info[STATUS_KEY]["limits"] = {
                "max_input_tokens": limits.max_input_tokens,
                "max_total_tokens": limits.max_total_tokens,
                "clip_output": admission.clip_output(),
            }
            info[STATUS_KEY]["tenants"] = "enforced" if tenant_guard.enforced() else "off"
    if problems:
        raise _refuse("http/tokenizer", problems)
    return infos
