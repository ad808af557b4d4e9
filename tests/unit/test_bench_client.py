"""The benchmarks' default load generator is still where the pinned SGLang ships it."""

import subprocess
import sys


def test_sglangs_rust_bench_client_loads_without_importing_sglang():
    code = (
        "import sys\n"
        "from glm53_serving.bench import rust_client\n"
        "assert callable(rust_client.load().run_argv)\n"
        "print('sglang' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False", out
    usage = subprocess.run(
        [sys.executable, "-m", "glm53_serving.bench.rust_client", "--help"], capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 0 and "--max-concurrency" in usage.stdout and "random-ids" in usage.stdout, usage
