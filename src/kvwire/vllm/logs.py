"""kvwire's log records inside vLLM: through vLLM's logging configuration.

vLLM configures only its own `vllm` logger (a handler with its format, its
level from `VLLM_LOGGING_LEVEL` or `--log-level`, its stream). kvwire's
loggers are outside it: left alone, their INFO lines are dropped and their
warnings come out bare, without vLLM's level, time and process. So in a vLLM
process kvwire hands each record of its `kvwire` logger to vLLM's, and
takes vLLM's level, unless vLLM configured no logging
(`VLLM_CONFIGURE_LOGGING=0`: the `vllm` logger has no handler) or the
application configured logging that shows kvwire's records already (a
handler on the `kvwire` logger or on the root logger): then it is left as
the application set it. Records still propagate, so a handler the
application adds to the root logger later sees them too.
"""

from __future__ import annotations

import logging

__all__ = ["follow_vllm_logging"]

KVWIRE_LOGGER = "kvwire"
VLLM_LOGGER = "vllm"


class _ToVLLMLogger(logging.Handler):
    """Hands each record to vLLM's logger, whose handlers format and filter it."""

    def emit(self, record: logging.LogRecord) -> None:
        # Whatever handlers vLLM's logger has now: a later reconfiguration
        # (vLLM applies its LoggingConfig in each process it starts) is followed.
        logging.getLogger(VLLM_LOGGER).handle(record)


def follow_vllm_logging() -> bool:
    """Route the `kvwire` logger through vLLM's, at vLLM's level; whether it now is.

    Called again (each connector built in a process), it takes vLLM's level
    once more: vLLM may have configured logging since.
    """
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    kvwire_logger = logging.getLogger(KVWIRE_LOGGER)
    ours = [handler for handler in kvwire_logger.handlers if isinstance(handler, _ToVLLMLogger)]
    configured_elsewhere = len(ours) != len(kvwire_logger.handlers) or logging.getLogger().handlers
    if not vllm_logger.handlers or configured_elsewhere:
        return False
    if not ours:
        kvwire_logger.addHandler(_ToVLLMLogger())
    kvwire_logger.setLevel(vllm_logger.getEffectiveLevel())
    return True
