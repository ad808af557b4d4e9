"""bench.attribution's reading of py-spy's raw output: which frames are ours, self vs inclusive."""

from glm53_serving.bench import attribution


def test_our_frames_are_named_by_module_and_the_hook_wrappers_apart():
    assert attribution.module_of("tag_and_check_decode (glm53_serving/kv_owner.py:170)") == "kv_owner"
    assert attribution.module_of("__call__ (glm53_serving/gateway/app.py:574)") == "gateway.app"
    assert attribution.module_of("f (/x/site-packages/glm53_serving/kv_zero.py:3)") == "kv_zero"
    assert attribution.module_of("wrapper (plugins/hook_registry.py:378)") == "hook wrappers"
    assert attribution.module_of("run_batch (scheduler.py:4704)") is None


def test_self_shares_add_up_and_inclusive_counts_each_stack_once(tmp_path):
    raw = tmp_path / "scheduler.txt"
    raw.write_text(
        "loop (scheduler.py:1);wrapper (plugins/hook_registry.py:378);"
        "tag_and_check_decode (glm53_serving/kv_owner.py:170);foreign (glm53_serving/kv_owner.py:126) 3\n"
        "loop (scheduler.py:1);wrapper (plugins/hook_registry.py:378);sparse_decode (glm53_serving/cpu_dsa.py:269);"
        "forward (linear.py:9) 5\n"
        "loop (scheduler.py:1);wrapper (plugins/hook_registry.py:378) 1\n"
        "a docstring line that py-spy split\n"
        "loop (scheduler.py:2) 11\n"
    )
    total, inclusive, own, functions, anyone = attribution.shares(raw)
    assert total == 20
    assert inclusive == {"kv_owner": 3, "cpu_dsa": 5}  # the wrappers count by self only
    assert own == {"kv_owner": 3, "hook wrappers": 1}  # cpu_dsa's 5 are linear.py's own
    assert functions == {"kv_owner.foreign": 3, "hook wrappers.wrapper": 1}
    assert anyone["loop (scheduler.py)"] == 11 and anyone["forward (linear.py)"] == 5
