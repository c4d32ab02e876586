"""A small paged-KV inference engine that drives connectors through their real lifecycle.

`from kvwire.engine import LLMEngine` imports torch; importing the package
alone does not (`kvwire run` applies a preset before anything needs torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvwire.engine.container import EngineContainer
    from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput, build_engine
    from kvwire.engine.workload import ByteTokenizer, WorkloadSpec, synthetic_workload

__all__ = [
    "ByteTokenizer",
    "EngineContainer",
    "GenerationRequest",
    "LLMEngine",
    "RequestOutput",
    "WorkloadSpec",
    "build_engine",
    "synthetic_workload",
]

_WHERE = {
    "EngineContainer": "kvwire.engine.container",
    "build_engine": "kvwire.engine.engine",
    "GenerationRequest": "kvwire.engine.engine",
    "LLMEngine": "kvwire.engine.engine",
    "RequestOutput": "kvwire.engine.engine",
    "ByteTokenizer": "kvwire.engine.workload",
    "WorkloadSpec": "kvwire.engine.workload",
    "synthetic_workload": "kvwire.engine.workload",
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
