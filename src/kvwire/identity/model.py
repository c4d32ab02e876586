"""Which weights a model's KV comes from: the identity that names its stored entries.

Engines load each other's blocks only when their block layouts' fingerprints
match (`kvwire.media.BlockLayout`), and the model's identity
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
   `weights:<digest>`, a digest of its configuration files (every
   top-level `*.json` but the tokenizer's and the sampling defaults', see
   `_NOT_COMPUTED_JSON`; remote code, `*.py`) and of every byte of each
   weight file, with their names. A directory with no weight file of a
   format known here has every file digested so. Each file's digest is
   computed once and remembered while the file is unchanged
   (`kvwire.identity.file_digests`). A snapshot's commit is not believed: its
   files are links into the hub cache's blobs, which can be edited in place
   or pointed elsewhere;
3. a hub id: its revision when that is a commit hash, else the commit the
   local hub cache says the revision (`main` by default) was downloaded at,
   `hub-commit:<commit>`: the files may not be downloaded yet when a worker
   starts, and the hub names a commit's files by their content. An id whose
   commit cannot be found locally is refused
   (`kvwire.exceptions.ModelIdentityError`), as a branch
   name alone can stand for other weights tomorrow.

The tokenizer takes no part: a block's hash is over token ids, and the KV of
given token ids depends only on the weights and the model's configuration.

The files digested must be those the engine computes with: `weight_stamps`
takes their stamps before the engine loads them, and `model_identity`
given those stamps refuses
(`kvwire.exceptions.UnreadableWeightsError`) a
model whose files are no longer the ones stamped (replaced, renamed over,
written, added or removed), naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvwire.common.redaction import shown
from kvwire.exceptions import ModelIdentityError as ModelIdentityError
from kvwire.exceptions import UnreadableWeightsError as UnreadableWeightsError
from kvwire.identity.file_digests import FileChangedError, FileDigests, FileStamp

IDENTITY_FIELD = "model_config.identity"
# An explicit identity is a name an operator types: printable, one line, bounded.
LONGEST_IDENTITY = 256

_COMMIT = re.compile(r"[0-9a-f]{40}")
# vLLM reads configuration from many JSON files of the model's folder, and
# more with each release: `config.json` or Mistral's `params.json`, a LoRA
# adapter's `adapter_config.json`, the weight index, every `*.json` whose name
# ends as a quantization method's config file (`hf_quant_config.json`,
# `quantize_config.json`, `quant_config.json`, ...:
# `get_quant_config` in `model_loader/weight_utils.py`),
# `sparse_attention_config.json`, `joint_head_config.json`, the multimodal
# processor's `preprocessor_config.json`, `processor_config.json` and
# `video_preprocessor_config.json` (pixel values, so image tokens' KV). So
# every top-level `*.json` is digested but those that only turn text into
# token ids or choose sampling defaults: a block's hash is over token ids,
# and sampling happens after the KV is computed.
_NOT_COMPUTED_JSON = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "tekken.json",
        "chat_template.json",
        "generation_config.json",
    }
)
# Read whole: small, and any change in them changes what the weights compute.
_CONFIG_SUFFIXES = (".json", ".py")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")
# Weight files digested at once: hashlib frees the GIL while it digests, so
# the shards of a large model are read side by side.
PARALLEL_FILES = 4
# v2: every byte of each weight file (v1 sampled them).
_DIGEST_VERSION = b"kvwire-weights-v2"
_CHANGED = "changed after the engine's configuration was built"

# Each file's stamp by name, taken before the engine loaded it (None: no stat then).
WeightStamps = Mapping[str, FileStamp | None]


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
    stamps: WeightStamps | None = None,
) -> str:
    """The identity of the weights `model` (a local path or a hub id) names; see the module.

    `hub_caches` are the hub cache directories to look a hub id up in
    (default: `default_hub_caches`). A relative path is taken from the
    working directory; only what it holds counts, never its name.
    `file_digests` remembers each weight file's digest (default: the
    per-user cache). `stamps`: `weight_stamps(model)` taken when the
    engine was configured, before it loaded the weights (None: not
    checked). Raises `kvwire.exceptions.UnreadableWeightsError`
    when a file there cannot be read, or is not the one stamped.
    """
    if explicit:
        check_explicit_identity(explicit)
        return f"explicit:{explicit}"
    if os.path.exists(model):
        return f"weights:{weights_digest(model, file_digests, stamps)}"
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


def weight_files(path: str) -> list[tuple[str, str]]:
    """The files at `path` (a directory or one file) its identity digests: (name, path) pairs.

    Raises OSError when a directory cannot be listed.
    """
    if not os.path.isdir(path):
        return [(os.path.basename(path), path)]
    listed = sorted(os.listdir(path))
    names = [name for name in listed if _counts(name)]
    if not any(name.endswith(_WEIGHT_SUFFIXES) for name in names):
        # No weight file of a format known here: every file counts,
        # so that no other format's weights are left out.
        names = [name for name in listed if not name.startswith(".")]
    files = [(name, os.path.join(path, name)) for name in names]
    # A dangling link among them fails when read: a model kvwire cannot read whole.
    return [(name, full) for name, full in files if not os.path.isdir(full)]


def weight_stamps(path: str) -> WeightStamps:
    """The stamp of each file `weights_digest(path)` digests, by name (None: no stat).

    Taken before an engine loads the weights, it lets `model_identity`
    tell that the files it digests are still those the engine read. A
    folder that cannot be listed has no files stamped: any it has later
    differ.
    """
    try:
        files = weight_files(path)
    except OSError:
        return {}
    stamps: dict[str, FileStamp | None] = {}
    for name, full in files:
        try:
            stamps[name] = FileStamp.of(os.stat(full))
        except OSError:
            stamps[name] = None
    return stamps


def weights_digest(
    path: str, file_digests: FileDigests | None = None, stamps: WeightStamps | None = None
) -> str:
    """A digest of the configuration and weight files at `path` (a directory or one file).

    Only file names (not the directory's) and contents count, so copies on
    other hosts or under other names digest the same. Every byte of each
    file is digested; `file_digests` remembers each file's digest while it
    is unchanged (default: the per-user cache). `stamps`: what
    `weight_stamps(path)` gave earlier; a file added, removed or changed
    since raises `UnreadableWeightsError` naming it.
    """
    digests = file_digests if file_digests is not None else FileDigests()
    digest = hashlib.sha256(_DIGEST_VERSION)
    try:
        files = weight_files(path)
        if stamps is not None:
            _require_stamped_names([name for name, _ in files], stamps, path)

        def digest_file(name: str, full: str) -> str:
            if stamps is None:
                return digests.digest(full)
            stamp = stamps[name]
            if stamp is None:
                # No stat when stamped: one now (or unreadable still) is another file.
                os.stat(full)
                raise FileChangedError(errno.ESTALE, _CHANGED, full)
            return digests.digest(full, stamp)

        with (
            digests.keeping_model(len(files)),
            ThreadPoolExecutor(min(PARALLEL_FILES, max(1, len(files)))) as pool,
        ):
            file_digests_in_order = list(
                pool.map(digest_file, [name for name, _ in files], [full for _, full in files])
            )
    except FileChangedError as error:
        # ESTALE: not the file stamped; else it changed while it was read.
        how = _CHANGED if error.errno == errno.ESTALE else error.strerror
        raise _changed_error(path, os.path.basename(str(error.filename)), how) from None
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


def _require_stamped_names(names: list[str], stamps: WeightStamps, path: str) -> None:
    differing = sorted(set(names).symmetric_difference(stamps))
    if differing:
        name = differing[0]
        how = "appeared" if name in names else "disappeared"
        raise _changed_error(path, name, f"{how} after the engine's configuration was built")


def _changed_error(path: str, name: str, how: str | None) -> UnreadableWeightsError:
    return UnreadableWeightsError(
        f"{IDENTITY_FIELD}: the model's file {shown(name)} at {shown(path)} {how or _CHANGED}, "
        "so the weights the engine computes with may not be the bytes kvwire digests; start "
        "the engine again once the files stay as they are, or set model_config.identity in "
        "the kvwire profile"
    )


def _counts(name: str) -> bool:
    if name in _NOT_COMPUTED_JSON:
        return False
    return name.endswith(_CONFIG_SUFFIXES + _WEIGHT_SUFFIXES)
