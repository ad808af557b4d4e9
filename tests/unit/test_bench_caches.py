"""bench.caches: the cold-cache sweep is sized from the CPU's largest cache."""

from glm53_serving.bench import caches


def cpu_with(tmp_path, sizes):
    for i, size in enumerate(sizes):
        d = tmp_path / "cache" / f"index{i}"
        d.mkdir(parents=True)
        (d / "size").write_text(size + "\n")
    return str(tmp_path)


def test_the_sweep_is_sized_from_the_largest_cache_not_the_first(tmp_path):
    cpu = cpu_with(tmp_path, ["48K", "2048K", "491520K", "64K"])
    assert caches.last_level_cache_bytes(cpu) == 480 << 20


def test_a_cpu_without_cache_entries_gets_the_fallback(tmp_path):
    assert caches.last_level_cache_bytes(str(tmp_path)) == caches.FALLBACK_BYTES


def test_the_sweeper_writes_twice_the_cache_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(caches, "last_level_cache_bytes", lambda: 1 << 20)
    sweep, nbytes = caches.sweeper()
    assert nbytes == 2 << 20
    sweep()
