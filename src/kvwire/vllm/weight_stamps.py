"""The model's files as vLLM was configured with them, carried to where kvwire digests them.

vLLM loads the weights before it builds a connector, and kvwire digests them
when the connector is built: a file renamed over the model's between the two
would have the engine compute with the old bytes under the new bytes'
identity, and load the KV of the new weights. So the config hook
(`kvwire.vllm.startup_check`, which runs in `EngineArgs.create_engine_config`
before any engine process starts or the model loads) stamps each file the
identity digests (device, inode, size, modification and change times), and
the stamps travel in the configuration vLLM hands every engine process:
`kv_transfer_config.kv_connector_extra_config`, under `WEIGHT_STAMPS_KEY`.
The connector's identity (`kvwire.vllm.config_bridge.vllm_model_identity`)
digests the files only while each is still the one stamped; otherwise the
engine shares nothing with any other, with a warning naming the file.

An engine configured without the hook (a `VllmConfig` built by hand) carries
no stamps: its files are digested as they are when its connector is built.
"""

from __future__ import annotations

import os
from typing import Any

from kvwire.exceptions import VLLMConfigError
from kvwire.identity.file_digests import FileStamp
from kvwire.identity.model import WeightStamps, weight_stamps

__all__ = ["WEIGHT_STAMPS_KEY", "record_weight_stamps", "recorded_weight_stamps"]

# Written by kvwire's config hook, never by an operator: a leading underscore.
WEIGHT_STAMPS_KEY = "_kvwire_weight_stamps"
_FIELD = f"kv_transfer_config.kv_connector_extra_config.{WEIGHT_STAMPS_KEY}"
_STAMP_FIELDS = 5


def record_weight_stamps(vllm_config: Any) -> None:
    """Put the stamps of the files at vLLM's `model` in its transfer config's extra config.

    Nothing for a `model` that is no local path (a hub id: its identity is
    a commit). A fresh extra-config mapping: the one vLLM was given may be
    the caller's own.
    """
    model = str(vllm_config.model_config.model)
    if not os.path.exists(model):
        return
    transfer = vllm_config.kv_transfer_config
    stamps = {
        name: None if stamp is None else stamp.as_list()
        for name, stamp in weight_stamps(model).items()
    }
    transfer.kv_connector_extra_config = {
        **(transfer.kv_connector_extra_config or {}),
        WEIGHT_STAMPS_KEY: stamps,
    }


def recorded_weight_stamps(vllm_config: Any) -> WeightStamps | None:
    """The stamps `record_weight_stamps` put in `vllm_config`; None where there are none.

    Raises `VLLMConfigError` naming the key for a value of another shape.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra_config = getattr(transfer, "kv_connector_extra_config", None) or {}
    if WEIGHT_STAMPS_KEY not in extra_config:
        return None
    recorded = extra_config[WEIGHT_STAMPS_KEY]
    if not isinstance(recorded, dict) or not all(
        isinstance(name, str) and (stamp is None or _is_stamp(stamp))
        for name, stamp in recorded.items()
    ):
        raise VLLMConfigError(
            f"{_FIELD}: expected a mapping of file names to [device, inode, size, mtime_ns, "
            "ctime_ns] or null, as kvwire's vLLM plugin writes it when vLLM builds its "
            "configuration; leave the key out of the configuration you give vLLM"
        )
    return {name: None if stamp is None else FileStamp(*stamp) for name, stamp in recorded.items()}


def _is_stamp(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == _STAMP_FIELDS
        and all(type(field) is int for field in value)
    )
