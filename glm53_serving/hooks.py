"""Every SGLang symbol glm53_serving hooks or overrides, in one table.

"What do we patch in SGLang?" has exactly one answer: `HOOKS` below. Each row names the
target (a dotted path into the pinned sglang==0.5.23), how we hook it, our implementation, the
parameter names we rely on (checked by tests/unit/test_hook_drift.py against the installed
SGLang), and why. `register()` hands the rows to SGLang's HookRegistry; `verify_applied()` proves
in a running process that each one really is in place, because HookRegistry only *logs* a hook
it could not apply and a security plugin must not serve unprotected (fail closed).

Kinds: BEFORE / AFTER / AROUND / REPLACE are HookRegistry's. ATTR sets a class attribute to a
constant (HookRegistry wraps callables only).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Kind(str, Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"
    ATTR = "attr"


@dataclass(frozen=True, slots=True)
class Hook:
    target: str
    kind: Kind
    impl: str | None  # "module:function" for callables; None for ATTR
    params: tuple[str, ...]  # the target's parameter names we depend on (ATTR: ())
    why: str
    guard: bool = True  # a security guard (off only with GLM53_SERVING_DISABLE=1) vs. a platform fix
    cpu_only: bool = False
    # A CPU row for GLM-5.x DSA models only (cpu_dsa.py): applied where the launcher serves one
    # (env.CPU_DSA), so other CPU servers do not import the DSA and DeepSeek modules it patches
    # (measured on 2 cores: importing SGLang's HTTP server 10.7 s, with those modules 11.5 s).
    dsa_only: bool = False
    value: Any = None  # ATTR only
    # Where the row is in effect and verified: "any" process, or only "scheduler" processes
    # (rows applied by a scheduler-side hook, so that other processes never import their module).
    process: str = "any"
    # The KV guard part the row belongs to ("zero", "owner", "handoff"): a part switched off
    # explicitly (plugin.KV_OFF_ENV) drops its rows; None: not a switchable part.
    part: str | None = None

    def __post_init__(self):
        # The table is ours, built at import: a malformed row is refused even under python -O.
        if not (
            self.target.startswith("sglang.")
            and (self.kind is Kind.ATTR) == (self.impl is None)
            and self.why
            and self.process in ("any", "scheduler")
            and self.part in (None, *KV_PARTS)
            and (self.cpu_only or not self.dsa_only)
        ):
            raise ValueError(f"malformed hook row: {self}")

    def resolve_impl(self) -> Callable:
        if self.impl is None:
            raise TypeError(f"{self.target} is an ATTR row: it has no implementation")
        return pkgutil.resolve_name(self.impl)


KV_PARTS = ("zero", "owner", "handoff")  # kv_zero.py, kv_owner.py, kv_handoff.py; kv_guard.py joins them

HOOKS: tuple[Hook, ...] = (
    # --- start-up handshake: fail closed (glm53_serving/startup.py) -------------------------
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_init_info",
        Kind.AFTER,
        "glm53_serving.startup:scheduler_verified_info",
        ("self",),
        "a scheduler whose hooks did not all apply raises instead of reporting ready, and a "
        "verified one tells the HTTP process so in its init info (and /server_info)",
        guard=False,  # also reports "disabled" when the guards are switched off
    ),
    Hook(
        "sglang.srt.entrypoints.engine._wait_for_scheduler_ready",
        Kind.AFTER,
        "glm53_serving.startup:require_verified_schedulers",
        ("scheduler_pipe_readers", "scheduler_procs"),
        "the HTTP/tokenizer process refuses to start unless every scheduler verified its hooks "
        "and its own hooks are in place",
        guard=False,
    ),
    # --- the worker's HTTP front door: one declared middleware stack (front_door.py) ----------
    Hook(
        "sglang.srt.entrypoints.http_server.launch_server",
        Kind.BEFORE,
        "glm53_serving.front_door:install_hook",
        ("server_args",),
        "install the front door (contract errors -> tenant -> body limit -> hard reject -> validation) "
        "while the app can still take middlewares: authentication before anything reads the body, a "
        "rejected request's 4xx before any byte of a 200 (upstream streams /generate rejections under HTTP 200)",
    ),
    Hook(
        "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
        Kind.BEFORE,
        "glm53_serving.front_door:warm_hook",
        ("server_args", "tokenizer_manager"),
        "build and warm the validator's checks from this server's tokenizer manager before it reports "
        "ready (built lazily, the first requests after start took 2 to 7 s)",
    ),
    Hook(
        "sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup",
        Kind.REPLACE,
        "glm53_serving.tenant_guard:freeze_gc_after_warmup",
        ("server_args",),
        "SGLang posts /freeze_gc to itself after warm-up without a credential the tenant guard takes "
        "(401: no worker heap was frozen); ours sends an in-process credential valid on that route only",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        Kind.BEFORE,
        "glm53_serving.intake:validate_request_hook",
        ("self", "obj", "input_ids"),
        "in the HTTP process, before any scheduler sees the request: token ids inside the "
        "vocabulary (upstream crashes), PD routing fields on PD roles (upstream decode crashes), "
        "and the deployment-wide length limit (upstream checks only context_len here)",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        Kind.BEFORE,
        "glm53_serving.intake:take_request_id_hook",
        ("self", "obj", "request"),
        "a request whose body names no rid is served under its x-request-id, the gateway's trace id that "
        "sglang-router forwards to prefill and decode (request_ids.py): one id from the gateway's audit to "
        "every worker's logs",
    ),
    Hook(
        "sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        Kind.AROUND,
        "glm53_serving.model:resolve_model_hook",
        ("self", "architectures"),
        "GlmMoeDsaForCausalLM resolves to the GLM-5.3 definition (model.py): SGLang's class, refusing a "
        "checkpoint of another shape (GLM-5.3-Flash, a wrong index_head_dim, no index_topk) before any "
        "weight is read; other architectures resolve as upstream",
    ),
    # --- tenants: owned sessions and requests (tenant_guard.py; route auth is its middleware) --
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.open_session",
        Kind.AROUND,
        "glm53_serving.tenant_guard:open_session_hook",
        ("self", "obj", "request"),
        "a session belongs to the tenant that opened it (upstream sessions have no owner)",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.close_session",
        Kind.BEFORE,
        "glm53_serving.tenant_guard:close_session_hook",
        ("self", "obj", "request"),
        "another tenant closing a session gets 404, as for a session that does not exist",
    ),
    Hook(
        "sglang.srt.session.session_controller.Session.create_req",
        Kind.AROUND,
        "glm53_serving.admission:session_turn_hook",
        ("self", "req"),
        "a session turn (history + new input) is admitted whole by the deployment's length limit; "
        "the HTTP process sees only the new input",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
        Kind.AROUND,
        "glm53_serving.tenant_guard:abort_request_hook",
        ("self", "rid", "abort_all"),
        "a tenant aborts only its own requests; abort_all is the operator's",
    ),
    # --- KV hygiene: zero before reuse (kv_zero.py) ----------------------------------------
    Hook(
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc",
        Kind.AFTER,
        "glm53_serving.kv_zero:zero_after_alloc",
        ("self", "need_size"),
        "page size 1: every slot handed out reads zeros until its request writes it",
        part="zero",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc",
        Kind.AFTER,
        "glm53_serving.kv_zero:zero_after_alloc",
        ("self", "need_size"),
        "paged pools: plain allocations (decode pre-allocation, chunked prefill) read zeros",
        part="zero",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend",
        Kind.AFTER,
        "glm53_serving.kv_zero:zero_after_alloc",
        ("self", "prefix_lens", "prefix_lens_cpu", "seq_lens"),
        "paged pools: prefill extension slots read zeros",
        part="zero",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode",
        Kind.AFTER,
        "glm53_serving.kv_zero:zero_after_alloc_decode",
        ("self", "seq_lens", "seq_lens_cpu", "last_loc"),
        "paged pools: a page a decode step opens reads zeros whole; a step continuing its "
        "request's page (63 in 64) costs one host test",
        part="zero",
    ),
    Hook(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
        Kind.AFTER,
        "glm53_serving.kv_guard:publish_prealloc",
        ("self", "req"),
        "PD decode: the destination is tagged with the request's owner (if that part is on) and "
        "the zero fills complete before its page indices go to prefill",
    ),
    # --- KV owner tags, checked before every read (kv_owner.py) -----------------------------
    Hook(
        "sglang.srt.mem_cache.allocation.alloc_for_extend",
        Kind.AFTER,
        "glm53_serving.kv_owner:tag_and_check_extend",
        ("batch",),
        "extend batch build: the new slots take the request's namespace, then every row of the "
        "batch is checked to hold only its own namespace's pages before the forward reads it",
        part="owner",
    ),
    Hook(
        "sglang.srt.mem_cache.allocation.alloc_for_decode",
        Kind.AFTER,
        "glm53_serving.kv_owner:tag_and_check_decode",
        ("batch", "token_per_req"),
        "decode batch build (in PD also the first step after a transfer): tag the new slot, "
        "check every row before the forward reads it",
        part="owner",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
        Kind.AFTER,
        "glm53_serving.kv_owner:reset_after_free",
        ("self", "free_index"),
        "page size 1: a freed slot has no owner (every free path ends here)",
        part="owner",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
        Kind.AFTER,
        "glm53_serving.kv_owner:reset_after_release",
        ("self",),
        "paged pools: a freed page has no owner (free, free_page_ids and free groups end here)",
        part="owner",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear",
        Kind.AFTER,
        "glm53_serving.kv_owner:reset_after_clear",
        ("self",),
        "page size 1: after a cache flush every slot is free and unowned",
        part="owner",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
        Kind.AFTER,
        "glm53_serving.kv_owner:reset_after_clear",
        ("self",),
        "paged pools: after a cache flush every page is free and unowned",
        part="owner",
    ),
    Hook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.kv_status_msg_carries_reason",
        Kind.ATTR,
        None,
        (),
        "PD: prefill fails the transfer of a request its owner check aborted (kv_owner._tell_decode) "
        "and decode answers with that reason (kv_isolation_violation); Mooncake's status message "
        "drops the reason unless asked (NIXL and Mori carry it)",
        value=True,
        process="scheduler",
        part="owner",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        Kind.AFTER,
        "glm53_serving.kv_guard:report_state",
        ("self",),
        "/server_info (operator only) reports the pool as the KV guard sees it: pages free, "
        "evictable and owned, requests held; after a drain and a cache flush none is owned",
        guard=False,
    ),
    # --- PD handoff length check (kv_handoff.py) --------------------------------------------
    Hook(
        "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf",
        Kind.AFTER,
        "glm53_serving.kv_handoff:carry_prompt_length",
        ("self", "req"),
        "PD prefill: carry the prompt length it sent KV for in a spare metadata slot",
        part="handoff",
    ),
    Hook(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
        Kind.AFTER,
        "glm53_serving.kv_handoff:check_prompt_length",
        ("self", "decode_req"),
        "PD decode: abort a request whose transfer did not cover exactly the pages pre-allocated "
        "for its prompt, before its first decode step",
        part="handoff",
    ),
    # --- the HTTP side of a KV abort (http_guard.py) ----------------------------------------
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_abort_finish_reason",
        Kind.BEFORE,
        "glm53_serving.http_guard:contract_abort_hook",
        ("self", "out", "state", "is_stream"),
        "a scheduler abort with one of our KV codes becomes the contract's 500 body (upstream "
        "sends its own body, or an error inside a 200 stream)",
    ),
    # --- scheduler-only ATTR rows, on every platform (plugin.py) ------------------------------
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        Kind.BEFORE,
        "glm53_serving.plugin:apply_scheduler_attrs",
        ("self", "server_args"),
        "set the process='scheduler' ATTR rows in scheduler processes only: importing the Mooncake "
        "module in the HTTP process would import prometheus_client before SGLang sets multiprocess "
        "mode. On every platform: the owner part's row above is one of them (registered on CPU only, "
        "a CUDA scheduler's self-check would have refused to start)",
        guard=False,
    ),
    # --- CPU development stack only (glm53_serving/cpu.py) ----------------------------------
    Hook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices",
        Kind.ATTR,
        None,
        (),
        "prefill's host-index send path allocates pin_memory tensors and a torch.cuda.Event "
        "(disaggregation/prefill.py _send_kv_chunk), which needs a CUDA driver",
        guard=False,
        cpu_only=True,
        value=False,
        process="scheduler",
    ),
    # --- GLM-5.x MLA + DSA on CPU (glm53_serving/cpu_dsa.py; the default model glm53-tiny) -------
    Hook(
        "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:model_adjustments_without_cuda",
        ("server_args",),
        "DSA models: the argument resolution calls torch.cuda.get_device_capability() outside "
        "NPU/XPU (arg_groups/model_hook.py:341), which raises without an NVIDIA driver",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.arg_groups.overrides._dsa_kv_cache_dtype_default",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:no_dsa_gpu_override",
        ("view",),
        "DSA models: reads the CUDA capability (overrides.py:512) and forces a bf16/fp8 KV cache "
        "(:527-550); the CPU path keeps the model dtype",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.arg_groups.overrides._dsa_split_backend_resolution",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:no_dsa_gpu_override",
        ("view",),
        "DSA models: reads the CUDA capability (overrides.py:631) to pick GPU-only DSA kernels; "
        "CPU attends with torch_native",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.layers.rotary_embedding.factory.get_rope_cpu",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:rope_cpu_plain_fallback",
        ("head_size", "rotary_dim", "max_position", "base", "is_neox_style"),
        "the CPU RoPE factory accepts only deepseek_yarn scaling (factory.py:478-482); GLM-5's "
        "attention and DSA indexer use plain RoPE, which the generic get_rope builds",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:torch_native_mla_handler",
        ("cls", "backend_name"),
        "MLA models: torch_native has no handler and falls back to triton's MHA prefill, which "
        "attends over the one-head latent pool (attention_backend_handler.py:55, "
        "torch_native_backend.py:315: shape error); torch_native takes the absorbed MLA path",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_native",
        Kind.REPLACE,
        "glm53_serving.cpu_dsa:indexer_forward_cpu",
        ("self",),
        "the DSA indexer has no CPU path (dsa_indexer.py:1888 raises, forward_cuda refuses non-GPU "
        "at :2245): a pure-PyTorch one writing fp8 index-K pages in SGLang's layout",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    Hook(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:sparse_extend",
        ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
        "DSA: the MLA forward passes topk_indices= (forward_mla.py:792-799), which torch_native "
        "does not take (torch_native_backend.py:279, TypeError); with it, sparse MLA attention",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
    *(
        Hook(
            f"sglang.srt.mem_cache.memory_pool.DSATokenToKVPool.{method}",
            Kind.AROUND,
            "glm53_serving.cpu_dsa:host_copy_without_cuda_sync",
            ("self",),
            "PD decode retraction backs a DSA request's latent and index-K pages up to host memory "
            "(mem_cache/memory_pool.py:5622-5654, index_key_cache.py:144-175) between "
            "torch.cuda.synchronize() calls, which raise without CUDA; on CPU a copy is complete when it returns",
            guard=False,
            cpu_only=True,
            dsa_only=True,
            process="scheduler",
        )
        for method in ("get_cpu_copy", "load_cpu_copy")
    ),
    Hook(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
        Kind.AROUND,
        "glm53_serving.cpu_dsa:sparse_decode",
        ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
        "DSA decode: as forward_extend (torch_native_backend.py:338)",
        guard=False,
        cpu_only=True,
        dsa_only=True,
    ),
)


# SGLang internals we use outside the table: what we call or import, and the attributes we read
# or set on SGLang's objects. tests/unit/test_hook_drift.py resolves each against the pinned
# release, so an upstream rename fails a test instead of a request.
INTERNALS: tuple[str, ...] = (
    "sglang.srt.disaggregation.utils._is_fake_transfer",  # kv_handoff: no prefill in a fake transfer
    "sglang.srt.disaggregation.utils.prepare_abort",  # kv_handoff: abort before decoding
    "sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST",  # intake: the fake host's value
    "sglang.srt.managers.schedule_batch.FINISH_ABORT",  # kv_owner, kv_handoff: the abort reason
    "sglang.srt.managers.schedule_batch.alloc_for_extend",  # kv_owner: the binding ScheduleBatch calls
    "sglang.srt.managers.schedule_batch.alloc_for_decode",
    "sglang.srt.mem_cache.common.evict_from_tree_cache",  # kv_owner: room for a quarantined row
    "sglang.srt.mem_cache.index_key_cache._use_aiter_preshuffle",  # kv_zero: the indexer layout
    "sglang.srt.entrypoints.http_server.app",  # front_door: the app the stack goes on
    "sglang.srt.entrypoints.http_server.get_global_state",  # request_guard: the tokenizer manager
    "sglang.srt.entrypoints.http_server.ssl_verify_of",  # tenant_guard: the internal /freeze_gc call
    "sglang.srt.entrypoints.api_contract.generate_contract_error",  # validation: /generate's contract
    "sglang.srt.entrypoints.openai.protocol.CompletionRequest",  # validation: the schemas
    "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest",
    "sglang.srt.managers.io_struct.GenerateReqInput",
    "sglang.srt.sampling.sampling_params.SamplingParams",  # validation: SGLang's own verify
    "sglang.srt.configs.model_config.is_multimodal_model",  # validation: text-only models
    "sglang.srt.runtime_context.get_disagg",  # env.role, startup
    "sglang.srt.runtime_context.get_serving",  # startup
    "sglang.srt.runtime_context.get_server_args",  # startup: server_flags
    "sglang.srt.utils.is_cpu",  # plugin: cpu_only rows
)
# class -> attributes of its instances we read or set (ours are prefixed _glm53_ and must not exist upstream)
INTERNAL_ATTRS: dict[str, tuple[str, ...]] = {
    "sglang.srt.managers.schedule_batch.Req": (
        "origin_input_ids",
        "cache_salt",
        "extra_key",
        "rid",
        "finished_reason",
        "to_finish",
        "skip_radix_cache_insert",
        "kv",
        "bootstrap_room",
        "disagg_kv_sender",
        "metadata_buffer_index",
    ),
    "sglang.srt.managers.schedule_batch.ScheduleBatch": (
        "reqs",
        "extend_lens",
        "prefix_lens",
        "seq_lens",
        "seq_lens_cpu",
        "req_pool_indices",
        "req_to_token_pool",
        "tree_cache",
    ),
    "sglang.srt.disaggregation.decode.DecodeRequest": ("req", "metadata_buffer_index", "is_rebootstrap"),
    "sglang.srt.disaggregation.decode.DecodePreallocQueue": ("token_to_kv_pool_allocator", "scheduler"),
    "sglang.srt.disaggregation.decode.DecodeTransferQueue": ("metadata_buffers",),
    "sglang.srt.disaggregation.utils.MetadataBuffers": ("cached_tokens",),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool": ("k_buffer", "v_buffer", "page_size", "size"),
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool": ("kv_buffer",),
    "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool": (
        "kv_buffer",
        "index_key_cache",
        "index_head_dim",
        "quant_block_size",
        "index_kpool",
        "index_page_size",
    ),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator": ("size", "page_size", "device", "get_kvcache"),
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager": ("conclude_failure",),
    "sglang.srt.managers.scheduler.Scheduler": (
        "token_to_kv_pool_allocator",
        "max_total_num_tokens",
        "page_size",
        "model_config",
        "enable_hisparse",
    ),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": ("model_config", "tokenizer", "sampling_params_class"),
}


def active_hooks(
    *, cpu: bool, guards: bool, parts_off: frozenset[str] = frozenset(), dsa: bool = False
) -> tuple[Hook, ...]:
    """The rows that apply to a process on this platform (serving a GLM-5.x DSA model on CPU or
    not) with guards on or off and the KV guard parts in `parts_off` switched off."""
    return tuple(
        h
        for h in HOOKS
        if (cpu or not h.cpu_only) and (dsa or not h.dsa_only) and (guards or not h.guard) and h.part not in parts_off
    )


def _split(target: str) -> tuple[Any, str]:
    owner, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner), attr


def resolve_target(target: str) -> Any:
    """The object currently at `target` (unwrapping classmethod/staticmethod descriptors)."""
    owner, attr = _split(target)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    return getattr(owner, attr)


def register(hooks: tuple[Hook, ...]) -> None:
    """Hand callable rows to HookRegistry; set process-wide ATTR rows now (scheduler-only ATTR
    rows are set by `apply_attrs` from a scheduler-side hook)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in hooks:
        if h.kind is not Kind.ATTR:
            HookRegistry.register(h.target, h.resolve_impl(), HookType(h.kind.value))
    apply_attrs(tuple(h for h in hooks if h.process == "any"))


def apply_attrs(hooks: tuple[Hook, ...]) -> None:
    for h in hooks:
        if h.kind is Kind.ATTR:
            owner, attr = _split(h.target)
            setattr(owner, attr, h.value)


def _chain_contains(fn: Any, impl: Callable) -> bool:
    """True if `impl` is one of the hooks in HookRegistry's wrapper chain around `fn`."""
    seen = 0
    while fn is not None and seen < 64:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is impl:
                    return True
            except ValueError:  # empty cell
                pass
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def verify_applied(hooks: tuple[Hook, ...], process: str = "scheduler") -> list[str]:
    """One line per row that is NOT in effect in this process (empty list: all good). In a
    non-scheduler process, rows that only schedulers carry are not checked."""
    missing = []
    for h in hooks:
        if h.process == "scheduler" and process != "scheduler":
            continue
        try:
            current = resolve_target(h.target)
        except Exception as e:  # noqa: BLE001 - any resolution failure is a missing hook
            missing.append(f"{h.target}: cannot resolve ({type(e).__name__}: {e})")
            continue
        if h.kind is Kind.ATTR:
            if current != h.value:
                missing.append(f"{h.target}: is {current!r}, expected {h.value!r}")
        elif not _chain_contains(current, h.resolve_impl()):
            missing.append(f"{h.target}: {h.kind.value} hook {h.impl} is not applied")
    return missing
