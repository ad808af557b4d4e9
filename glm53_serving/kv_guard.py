"""The KV guard as a whole: its three parts, and the two places where they meet.

Parts (each switchable on its own with GLM53_KV_GUARD_OFF, all on by default; hooks.KV_PARTS):
- "zero"    kv_zero.py: every KV slot handed out reads zeros until its request writes it;
- "owner"   kv_owner.py: every page carries its owner, checked before every read;
- "handoff" kv_handoff.py: PD decode decodes only over the prompt length prefill sent KV for.

They meet (1) at PD decode's pre-allocation, where the destination is tagged with its owner and
the zero fills must complete before its page indices go to prefill, and (2) at start-up, where a
scheduler whose allocator a part on cannot guard refuses to start.
"""

from __future__ import annotations

import torch

from glm53_serving import kv_owner, kv_zero, plugin


def publish_prealloc(result, self, req, *args, **kwargs):
    """AFTER DecodePreallocQueue._pre_alloc: tag the destination with req's owner (if that part
    is on), then publish. The zero fills are queued on the device stream; wait for them before
    the page indices can be published to prefill, whose writes land over the network and do not
    wait for our stream (vLLM zeroed after the transfer and clobbered landed KV; this is the other
    order). CPU ops are synchronous already."""
    if plugin.kv_part_on("owner"):
        kv_owner.tag_prealloc(result, self, req)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return result


def allocator_problems(allocator) -> list[str]:
    """Why the parts switched on cannot guard this scheduler's allocator (empty: they can).
    The owner part needs the zeroing code too: a quarantined row gets fresh zeroed pages."""
    problems = []
    if plugin.kv_part_on("zero") or plugin.kv_part_on("owner"):
        problems += kv_zero.allocator_problems(allocator)
    if plugin.kv_part_on("owner"):
        problems += kv_owner.allocator_problems(allocator)
    return problems
