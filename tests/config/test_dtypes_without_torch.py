"""The dtype table and configuration import where torch is not installed."""

from __future__ import annotations

import subprocess
import sys


def test_configuration_and_the_dtype_table_import_without_torch() -> None:
    # A blocked import makes any ``import torch`` raise ImportError, as in a
    # venv without the torch extra.
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvwire.config, kvwire.config.dtypes, kvwire.config.kv_cache\n"
        "assert kvwire.config.dtypes.DTYPES['bfloat16'].size == 2\n"
        "assert kvwire.config.ModelConfig(dtype='float8_e5m2').dtype_size == 1\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
