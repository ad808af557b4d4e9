"""Start-up handshake: a server whose hooks are not all in place refuses to start.

Invariant: no SGLang server with this plugin installed reports ready unless, in the scheduler
*and* in the HTTP/tokenizer process, every hook of `hooks.HOOKS` that applies is in effect
(or the guards were switched off explicitly, which is then reported).

Two halves, so that neither process can be unprotected silently:
1. each scheduler verifies its own hooks inside `get_init_info` and raises instead of
   reporting ready (SGLang then takes the whole server down), and stamps its init info with
   `glm53_serving` status;
2. the HTTP/tokenizer process, when the scheduler infos arrive, verifies its own hooks and
   refuses unless every scheduler's info carries that stamp. A scheduler in which the plugin
   never loaded has no stamp.
The launcher adds a third check from outside: `/server_info` must report the plugin active.
"""

from __future__ import annotations

import logging

from glm53_serving import plugin

logger = logging.getLogger("glm53_serving")

STATUS_KEY = "glm53_serving"


class RefuseToStart(RuntimeError):
    pass


def _refuse(where: str, problems: list[str]) -> RefuseToStart:
    msg = f"glm53_serving: refusing to start ({where}): " + "; ".join(problems)
    logger.error(msg)
    return RefuseToStart(msg)


def scheduler_verified_info(result: dict, self) -> dict:
    """AFTER Scheduler.get_init_info."""
    problems = plugin.problems()
    if problems:
        raise _refuse("scheduler", problems)
    result[STATUS_KEY] = plugin.status()
    return result


def require_verified_schedulers(infos: list, scheduler_pipe_readers=None, scheduler_procs=None) -> list:
    """AFTER engine._wait_for_scheduler_ready (runs in the HTTP/tokenizer process)."""
    problems = plugin.problems()
    for i, info in enumerate(infos):
        if STATUS_KEY not in info:
            problems.append(f"scheduler {i} did not run glm53_serving's start-up check")
    if problems:
        raise _refuse("http/tokenizer", problems)
    return infos
