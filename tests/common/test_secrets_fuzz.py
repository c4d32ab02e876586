"""A fuzzer that plants a secret in many places and forms of a profile and greps every output.

Valid and invalid profiles, composite children, URLs, values of the wrong
type beside the secret and YAML syntax errors on its line: whatever
``kvwire check``, ``load_profile``, the records' reprs and the logs say,
the secret is never part of it.
"""

from __future__ import annotations

import io
import logging
import pathlib
import tempfile
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvwire.cli import check_profile
from kvwire.config.profile import load_profile

# Characters a password holds, '/', '@' and '%' among them (forms that broke
# URL parsing); not spaces or quotes, which end a value in any text format.
_SECRET_CHARACTERS = st.characters(
    codec="ascii", categories=("L", "N"), include_characters="/@%+=_-.!~"
)


@st.composite
def secrets(draw: st.DrawFn) -> str:
    # A marker that appears nowhere else, with a drawn tail.
    return "Zq9" + draw(st.text(_SECRET_CHARACTERS, min_size=5, max_size=20))


def secret_forms(secret: str) -> st.SearchStrategy[dict[str, Any]]:
    """One extra-config entry holding ``secret``, valid or not."""
    return st.sampled_from(
        [
            {"password": secret},
            {"password": [secret]},
            {"password": {"nested": secret}},
            {"redis_password": secret},
            {"token": secret},
            {"api_token": secret},
            {"client_secret": secret},
            {"url": f"redis://:{secret}@cache:6379/0"},
            {"url": f"redis://kv:{secret}@cache:6379/0"},
            {"url": f"rediss://kv:{secret}@cache:bad/0"},
            {"url": f"redis://{secret}@cache/0"},
            {"url": f"redis://cache/0?password={secret}"},
            {"url": [f"redis://:{secret}@cache/0"]},
            {"url": {"value": f"redis://:{secret}@cache/0"}},
        ]
    )


# Siblings that send the check down its error paths.
_NOISE = st.sampled_from(
    [
        {},
        {1: "not a string key"},
        {"pool_size": "x"},
        {"pool_sizee": 3},
        {"ttl_seconds": -1},
        {"db": 1, "url": "redis://h/2"},
        {"cpu_pool_bytes": "1 parsec"},
        {"max_save_bytes_in_flight": "100TiB"},
    ]
)
_CONNECTORS = st.sampled_from(
    ["RedisConnector", "CPUOffloadConnector", "SharedStorageConnector", "NoSuchConnector"]
)
_TRANSFER_NOISE = st.sampled_from(
    [{}, {"kv_port": "x"}, {"kv_role": "producer"}, {"kv_ip": ["list"]}, {"unknown": 1}]
)


@st.composite
def profiles(draw: st.DrawFn, secret: str) -> dict[str, Any]:
    extra = {**draw(_NOISE), **draw(secret_forms(secret))}
    transfer: dict[str, Any] = {
        "kv_connector": draw(_CONNECTORS),
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        **draw(_TRANSFER_NOISE),
    }
    if draw(st.booleans()):
        # The secret in a composite's child instead, beside a healthy sibling.
        sibling = {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": {}}
        child = {**transfer, **draw(_TRANSFER_NOISE)}
        children = draw(st.permutations([child, sibling]))
        transfer = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": children},
        }
    return {"kv_transfer_config": transfer}


def broken_yaml(text: str, secret: str, breakage: int) -> str:
    """``text`` with a YAML syntax error on (or right after) the line holding ``secret``."""
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if secret in line)
    line = lines[index]
    lines[index] = [
        line.replace(secret, f'"{secret}'),  # an unterminated quote
        line.replace(secret, f"[{secret}"),  # an unclosed flow sequence
        line.replace(secret, f"{secret}: x"),  # a mapping where a scalar goes
        line.replace(secret, f"*{secret}"),  # an undefined alias named like it
        f"{line}\n\t{secret}",  # a tab
        line.replace(secret, f"{secret} @x"),  # a reserved character
    ][breakage]
    return "\n".join(lines) + "\n"


def parses(text: str) -> bool:
    try:
        yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return True


def everything_shown(text: str, caplog: pytest.LogCaptureFixture) -> str:
    shown: list[str] = []
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "profile.yaml"
        path.write_text(text)
        out, err = io.StringIO(), io.StringIO()
        check_profile(str(path), out=out, err=err)
        shown += [out.getvalue(), err.getvalue()]
        try:
            engine_config = load_profile(path)
        except Exception as error:  # every kind: its text is what is checked
            shown += [str(error), repr(error)]
        else:
            shown += [repr(engine_config), str(engine_config)]
    shown.append(caplog.text)
    return "\n".join(shown)


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_no_output_of_a_profile_holding_a_secret_shows_it(
    data: st.DataObject, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    secret = data.draw(secrets())
    profile = data.draw(profiles(secret))
    text = yaml.safe_dump(profile, default_flow_style=data.draw(st.booleans()))
    if data.draw(st.booleans()):
        text = broken_yaml(text, secret, data.draw(st.integers(0, 5)))
        # Only a syntax error: a breakage that still parses moves the secret
        # out of any place a secret could be recognised in.
        assume(not parses(text))

    output = everything_shown(text, caplog)

    assert secret not in output, text
