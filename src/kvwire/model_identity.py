"""Which weights a model's KV comes from: the identity that names its stored entries.

Engines load each other's blocks only when their block layouts' fingerprints
match (:class:`kvwire.blocks.format.BlockLayout`), and the model's identity
is part of the fingerprint. It must change whenever the weights do, and stay
the same for the same weights wherever they live, so that engines on several
hosts share one store. A model's path or hub id is neither: ``model`` in two
working directories, ``/models/x`` on two hosts, or a hub id whose branch
moved can each hold other weights. So the identity is decided, first match
wins, as:

1. the operator's: ``model_config.identity`` in the kvwire profile, taken as
   given (for weights kvwire cannot read, or several copies an operator
   knows are the same);
2. a Hugging Face hub snapshot directory (``.../models--org--name/snapshots/
   <commit>``): its commit, ``hub-commit:<commit>``;
3. any other local directory or file: ``weights:<digest>``, a digest of its
   configuration files whole (``config.json``, ``params.json``, the weight
   index files, remote code) and of each weight file's name, size and a
   fixed sample of its bytes (the start, where safetensors keeps its tensor
   table, the end, and evenly spaced pieces between): a few MiB read per
   file, however large. A directory with no weight file of a format known
   here has every file digested so;
4. a hub id: its revision when that is a commit hash, else the commit the
   local hub cache says the revision (``main`` by default) was downloaded
   at; an id whose commit cannot be found locally is refused
   (:class:`ModelIdentityError`), as a branch name alone can stand for
   other weights tomorrow.

The tokenizer takes no part: a block's hash is over token ids, and the KV of
given token ids depends only on the weights and the model's configuration.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Sequence

from kvwire.exceptions import KVWireError
from kvwire.redaction import shown

IDENTITY_FIELD = "model_config.identity"
# An explicit identity is a name an operator types: printable, one line, bounded.
LONGEST_IDENTITY = 256

_COMMIT = re.compile(r"[0-9a-f]{40}")
# Read whole: small, and any change in them changes what the weights compute.
_CONFIG_FILES = frozenset({"config.json", "params.json"})
_CONFIG_SUFFIXES = (".index.json", ".py")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")
# A file up to this size is read whole; past it, sampled.
WHOLE_FILE_BYTES = 4 * 1024 * 1024
HEAD_BYTES = 1024 * 1024
SAMPLE_BYTES = 64 * 1024
SAMPLES = 16
_DIGEST_VERSION = b"kvwire-weights-v1"


class ModelIdentityError(KVWireError, ValueError):
    """A model kvwire cannot identify by its weights; the message says how to name it."""


def check_explicit_identity(value: object) -> None:
    """Refuse an explicit identity that is not a short printable string (empty: unset)."""
    if not isinstance(value, str):
        raise TypeError(f"identity must be a string, got {shown(value)}")
    if len(value) > LONGEST_IDENTITY or not value.isprintable() or value != value.strip():
        raise ValueError(
            f"identity must be a printable one-line name of at most {LONGEST_IDENTITY} "
            f"characters without surrounding spaces (such as 'acme-llama-8b-ft-2026-11'), "
            f"or empty to derive it from the weights; got {shown(value)}"
        )


def model_identity(
    model: str,
    revision: str | None = None,
    *,
    explicit: str = "",
    hub_caches: Sequence[str] = (),
) -> str:
    """The identity of the weights ``model`` (a local path or a hub id) names; see the module.

    ``hub_caches`` are the hub cache directories to look a hub id up in
    (default: :func:`default_hub_caches`). A relative path is taken from the
    working directory; only what it holds counts, never its name.
    """
    if explicit:
        check_explicit_identity(explicit)
        return f"explicit:{explicit}"
    if os.path.exists(model):
        commit = snapshot_commit(model)
        if commit is not None:
            return f"hub-commit:{commit}"
        return f"weights:{weights_digest(model)}"
    commit = _hub_commit(model, revision, hub_caches or default_hub_caches())
    if commit is None:
        raise ModelIdentityError(
            f"{IDENTITY_FIELD}: the model {shown(model)} (revision {shown(revision or 'main')}) "
            "is no local path and no commit of it is in the local hub cache, so kvwire cannot "
            "tell which weights it names; give vLLM a commit hash as its revision, a local "
            "directory, or set model_config.identity in the kvwire profile to a name that "
            "changes whenever the weights do"
        )
    return f"hub-commit:{commit}"


def snapshot_commit(path: str) -> str | None:
    """The commit of a hub snapshot directory (``models--*/snapshots/<commit>``); None otherwise."""
    absolute = os.path.abspath(path)
    snapshots = os.path.dirname(absolute)
    name = os.path.basename(absolute)
    if (
        os.path.isdir(absolute)
        and os.path.basename(snapshots) == "snapshots"
        and os.path.basename(os.path.dirname(snapshots)).startswith("models--")
        and _COMMIT.fullmatch(name)
    ):
        return name
    return None


def default_hub_caches() -> list[str]:
    """Where the hub client keeps downloads: ``$HF_HUB_CACHE``, or ``$HF_HOME/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return [os.environ["HF_HUB_CACHE"]]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return [os.path.join(home, "hub")]


def _hub_commit(model: str, revision: str | None, caches: Iterable[str]) -> str | None:
    if revision and _COMMIT.fullmatch(revision):
        return revision
    repo_folder = "models--" + model.replace("/", "--")
    for cache in caches:
        ref = os.path.join(cache, repo_folder, "refs", revision or "main")
        try:
            with open(ref, encoding="ascii") as ref_file:
                commit = ref_file.read(64).strip()
        except (OSError, ValueError):
            continue
        if _COMMIT.fullmatch(commit) and os.path.isdir(
            os.path.join(cache, repo_folder, "snapshots", commit)
        ):
            return commit
    return None


def weights_digest(path: str) -> str:
    """A digest of the configuration and weight files at ``path`` (a directory or one file).

    Only file names (not the directory's) and contents count, so copies on
    other hosts or under other names digest the same.
    """
    digest = hashlib.sha256(_DIGEST_VERSION)
    try:
        if os.path.isdir(path):
            listed = sorted(os.listdir(path))
            names = [name for name in listed if _counts(name)]
            if not any(name.endswith(_WEIGHT_SUFFIXES) for name in names):
                # No weight file of a format known here: every file counts,
                # so that no other format's weights are left out.
                names = [name for name in listed if not name.startswith(".")]
            files = [(name, os.path.join(path, name)) for name in names]
            # A dangling link among them raises here: a model kvwire cannot read whole.
            files = [(name, full) for name, full in files if not os.path.isdir(full)]
        else:
            files = [(os.path.basename(path), path)]
        for name, full in files:
            _digest_file(digest.update, name, full)
    except OSError as error:
        raise ModelIdentityError(
            f"{IDENTITY_FIELD}: cannot read the model's files at {shown(path)} to tell its "
            f"weights apart ({error.strerror or type(error).__name__}); make them readable, "
            "or set model_config.identity in the kvwire profile"
        ) from None
    return digest.hexdigest()[:32]


def _counts(name: str) -> bool:
    return name in _CONFIG_FILES or name.endswith(_CONFIG_SUFFIXES + _WEIGHT_SUFFIXES)


def _digest_file(update: Callable[[bytes], object], name: str, path: str) -> None:
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        update(f"\0{name}\0{size}\0".encode())
        if size <= WHOLE_FILE_BYTES:
            update(file.read(size))
            return
        for offset, length in sample_ranges(size):
            file.seek(offset)
            update(file.read(length))


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` pieces of a file of ``size`` bytes (> WHOLE_FILE_BYTES) digested.

    The head, :data:`SAMPLES` pieces evenly spaced after it, and the tail;
    fixed by the size alone, so equal files are read at equal places.
    """
    ranges = [(0, HEAD_BYTES)]
    span = size - HEAD_BYTES - SAMPLE_BYTES
    for index in range(1, SAMPLES + 1):
        ranges.append((HEAD_BYTES + span * index // (SAMPLES + 1), SAMPLE_BYTES))
    ranges.append((size - SAMPLE_BYTES, SAMPLE_BYTES))
    return ranges
