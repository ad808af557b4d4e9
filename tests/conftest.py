import os

# The test suite runs on the CPU development stack (scripts/setup); SGLang's CPU paths are
# gated on this variable at import time, so it must be set before anything imports sglang.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
