"""python -m glm53_serving.bench.rust_client ARGS: sglang.bench_serving's Rust client
(`python -m sglang.benchmark.rust_client ARGS`, the same flags, report and result lines) without
importing the sglang package first.

`import sglang` takes ~4 s of CPU on this 2-core machine; the bench starts a client per round,
and with both sides at once (`bench.serving gateway --simultaneous`) one client's imports would
land on the other's measured load. The extension module is the one SGLang's wheel ships and its
own loader would pick (`load_rust_extension`, mode auto, installed wheel)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXTENSION = "sglang.srt.rust_extensions._bench"


def load():
    package = importlib.util.find_spec("sglang")  # locates it; runs nothing of it
    if package is None or package.origin is None:
        raise SystemExit("sglang is not installed")
    folder = Path(package.origin).parent / "srt" / "rust_extensions"
    found = sorted(folder.glob("_bench.*.so"))
    if not found:
        raise SystemExit(f"sglang's Rust bench client is not in {folder}")
    spec = importlib.util.spec_from_file_location(EXTENSION, found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        load().run_argv(["python -m sglang.benchmark.rust_client", *args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
