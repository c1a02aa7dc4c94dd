"""outrate: per-user output-token rate limits for vLLM.

The core (this package) never imports vllm, torch or watchdog at import time,
so `outrate lint` starts fast and works without vLLM installed.
"""

__version__ = "0.1.0"
