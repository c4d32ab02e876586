"""Which weights a model's KV comes from: the identity that names its stored entries.

Engines load each other's blocks only when their block layouts' fingerprints
match ([`kvwire.blocks.format.BlockLayout`][kvwire.media.BlockLayout]), and the model's identity
is part of the fingerprint. It must change whenever the weights do, and stay
the same for the same weights wherever they live, so that engines on several
hosts share one store. A model's path or hub id is neither: `model` in two
working directories, `/models/x` on two hosts, or a hub id whose branch
moved can each hold other weights. So the identity is decided, first match
wins, as:

1. the operator's: `model_config.identity` in the kvwire profile, taken as
   given (for weights kvwire cannot read, or several copies an operator
   knows are the same);
2. any local directory or file, a hub snapshot directory included:
   `weights:<digest>`, a digest of its configuration files (`config.json`,
   `params.json`, a LoRA adapter's `adapter_config.json`, the weight
   index files, remote code) and of every byte of
   each weight file, with their names. A directory with no weight file of a
   format known here has every file digested so. Each file's digest is
   computed once and remembered while the file is unchanged
   (`kvwire._file_digests`). A snapshot's commit is not believed: its
   files are links into the hub cache's blobs, which can be edited in place
   or pointed elsewhere;
3. a hub id: its revision when that is a commit hash, else the commit the
   local hub cache says the revision (`main` by default) was downloaded at,
   `hub-commit:<commit>`: the files may not be downloaded yet when a worker
   starts, and the hub names a commit's files by their content. An id whose
   commit cannot be found locally is refused
   ([`ModelIdentityError`][kvwire.exceptions.ModelIdentityError]), as a branch
   name alone can stand for other weights tomorrow.

The tokenizer takes no part: a block's hash is over token ids, and the KV of
given token ids depends only on the weights and the model's configuration.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvwire._file_digests import FileDigests
from kvwire.exceptions import ModelIdentityError as ModelIdentityError
from kvwire.exceptions import UnreadableWeightsError as UnreadableWeightsError
from kvwire.redaction import shown

IDENTITY_FIELD = "model_config.identity"
# An explicit identity is a name an operator types: printable, one line, bounded.
LONGEST_IDENTITY = 256

_COMMIT = re.compile(r"[0-9a-f]{40}")
# Read whole: small, and any change in them changes what the weights compute.
_CONFIG_FILES = frozenset({"config.json", "params.json", "adapter_config.json"})
_CONFIG_SUFFIXES = (".index.json", ".py")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")
# Weight files digested at once: hashlib frees the GIL while it digests, so
# the shards of a large model are read side by side.
PARALLEL_FILES = 4
# v2: every byte of each weight file (v1 sampled them).
_DIGEST_VERSION = b"kvwire-weights-v2"


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
    file_digests: FileDigests | None = None,
) -> str:
    """The identity of the weights `model` (a local path or a hub id) names; see the module.

    `hub_caches` are the hub cache directories to look a hub id up in
    (default: `default_hub_caches`). A relative path is taken from the
    working directory; only what it holds counts, never its name.
    `file_digests` remembers each weight file's digest (default: the
    per-user cache). Raises [`UnreadableWeightsError`][kvwire.exceptions.UnreadableWeightsError]
    when a file there cannot be read.
    """
    if explicit:
        check_explicit_identity(explicit)
        return f"explicit:{explicit}"
    if os.path.exists(model):
        return f"weights:{weights_digest(model, file_digests)}"
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


def default_hub_caches() -> list[str]:
    """Where the hub client keeps downloads: `$HF_HUB_CACHE`, or `$HF_HOME/hub`."""
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


def weights_digest(path: str, file_digests: FileDigests | None = None) -> str:
    """A digest of the configuration and weight files at `path` (a directory or one file).

    Only file names (not the directory's) and contents count, so copies on
    other hosts or under other names digest the same. Every byte of each
    file is digested; `file_digests` remembers each file's digest while it
    is unchanged (default: the per-user cache).
    """
    digests = file_digests if file_digests is not None else FileDigests()
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
            # A dangling link among them fails when read: a model kvwire cannot read whole.
            files = [(name, full) for name, full in files if not os.path.isdir(full)]
        else:
            files = [(os.path.basename(path), path)]
        with ThreadPoolExecutor(min(PARALLEL_FILES, max(1, len(files)))) as pool:
            file_digests_in_order = list(pool.map(digests.digest, [full for _, full in files]))
    except OSError as error:
        raise UnreadableWeightsError(
            f"{IDENTITY_FIELD}: cannot read the model's files at {shown(path)} to tell its "
            f"weights apart ({error.strerror or type(error).__name__}"
            f"{f': {shown(os.path.basename(str(error.filename)))}' if error.filename else ''}); "
            "make them readable, or set model_config.identity in the kvwire profile"
        ) from None
    for (name, _), file_digest in zip(files, file_digests_in_order, strict=True):
        digest.update(f"\0{name}\0{file_digest}\0".encode())
    return digest.hexdigest()[:32]


def _counts(name: str) -> bool:
    return name in _CONFIG_FILES or name.endswith(_CONFIG_SUFFIXES + _WEIGHT_SUFFIXES)
