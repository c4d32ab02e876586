"""kvwire's conformance kit for KV connectors: a pytest plugin and a reusable suite.

Its two fault injectors fail chosen loads alike:
`kvwire.testing.with_load_faults` around a connector (to test a
connector), `kvwire.testing.FaultInjectingMedium` around a medium
beneath the offload connector (to test a medium, or the offload connector's recovery).

`from kvwire.testing import ConnectorConformanceSuite` imports the engine
(and torch); the pytest plugin itself (`kvwire.testing.plugin`) does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvwire.testing.configs import (
        conformance_engine_config,
        hybrid_engine_config,
        with_load_failure_policy,
    )
    from kvwire.testing.faults import (
        LoadFault,
        LoadFaultConnector,
        LoadFaultMetadata,
        LoadFaultsHook,
        with_load_faults,
    )
    from kvwire.testing.faulty_medium import FaultInjectingHandler, FaultInjectingMedium, LoadFaults
    from kvwire.testing.idle import IdleConnector
    from kvwire.testing.instruments import CallLog, CallRecord, Instruments, RoleViolationError
    from kvwire.testing.parallel_suite import Computed, ParallelConformanceSuite
    from kvwire.testing.suite import ConnectorConformanceSuite, HybridRun, PassResult

__all__ = [
    "CallLog",
    "CallRecord",
    "Computed",
    "ConnectorConformanceSuite",
    "FaultInjectingHandler",
    "FaultInjectingMedium",
    "HybridRun",
    "IdleConnector",
    "Instruments",
    "LoadFault",
    "LoadFaultConnector",
    "LoadFaultMetadata",
    "LoadFaults",
    "LoadFaultsHook",
    "ParallelConformanceSuite",
    "PassResult",
    "RoleViolationError",
    "conformance_engine_config",
    "hybrid_engine_config",
    "with_load_failure_policy",
    "with_load_faults",
]

_WHERE = {
    "CallLog": "kvwire.testing.instruments",
    "CallRecord": "kvwire.testing.instruments",
    "Computed": "kvwire.testing.parallel_suite",
    "FaultInjectingHandler": "kvwire.testing.faulty_medium",
    "FaultInjectingMedium": "kvwire.testing.faulty_medium",
    "HybridRun": "kvwire.testing.suite",
    "PassResult": "kvwire.testing.suite",
    "LoadFault": "kvwire.testing.faults",
    "LoadFaultConnector": "kvwire.testing.faults",
    "LoadFaultMetadata": "kvwire.testing.faults",
    "LoadFaults": "kvwire.testing.faulty_medium",
    "Instruments": "kvwire.testing.instruments",
    "RoleViolationError": "kvwire.testing.instruments",
    "ConnectorConformanceSuite": "kvwire.testing.suite",
    "ParallelConformanceSuite": "kvwire.testing.parallel_suite",
    "LoadFaultsHook": "kvwire.testing.faults",
    "IdleConnector": "kvwire.testing.idle",
    "conformance_engine_config": "kvwire.testing.configs",
    "hybrid_engine_config": "kvwire.testing.configs",
    "with_load_failure_policy": "kvwire.testing.configs",
    "with_load_faults": "kvwire.testing.faults",
}


# Lazy: the suite pulls in the engine and torch, the instruments do not.
__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
