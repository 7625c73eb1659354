"""Where a model's files come from: a local folder, or a Hugging Face Hub repository fetched into the
Hub's cache, as `vllm serve Qwen/Qwen3-0.6B` fetches it.

Nothing here imports torch: `serve` resolves the model before anything heavy loads.
"""

from __future__ import annotations

import glob
import json
import logging
import os

logger = logging.getLogger(__name__)

# what the config and the tokenizer read; the weights come after, as weight_files says. The .bin,
# .pth, GGUF and ONNX copies of the weights that many repositories also hold are left on the Hub
MODEL_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*")
REMOTE_CODE_PATTERNS = ("*.py",)   # the repository's own classes, read only with trust_remote_code
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(folder: str) -> list[str]:
    """The *.safetensors names of a model folder that hold its weights: those its index lists when
    it has one (a repository may also keep another copy, as Mistral's consolidated.safetensors
    beside its shards), else every one."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        return _indexed_files(index)
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))


def _indexed_files(index: str) -> list[str]:
    """The files an index's weight_map names; ValueError for an index that is not one (its loader
    raised KeyError or TypeError), or that names a file outside its folder."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = None
    if not names or not all(isinstance(name, str) and name.endswith(".safetensors") and not os.path.isabs(name)
                            and ".." not in name.replace("\\", "/").split("/") for name in names):
        raise ValueError(f"{index} is not a safetensors index: it needs a 'weight_map' of "
                         "tensor names to *.safetensors files in its folder")
    return sorted(names)


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None,
                  trust_remote_code: bool = False) -> str:
    """The local folder of model `name`: itself when it is a folder, else the snapshot of the Hub
    repository `name` (at `revision`) in the Hub's cache, or in `download_dir`, downloaded when
    missing. HF_TOKEN and HF_HUB_OFFLINE apply as the Hub's own tools read them.

    Raises ValueError naming what to change when it is neither."""
    if os.path.isdir(name):
        if revision is not None:   # a folder has no revisions: the flag was meant for a Hub id
            logger.warning("--revision %s is ignored: %s is a local folder, served as it is", revision, name)
        return name
    if _is_a_path(name):   # no Hub id looks so: refused as the folder it meant, without asking the Hub
        raise ValueError(_no_folder(name))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    neither = (f"Model {name!r} is not a local folder, and not a Hugging Face Hub repository this machine can "
               "fetch")
    patterns = list(MODEL_FILE_PATTERNS) + (list(REMOTE_CODE_PATTERNS) if trust_remote_code else [])
    logger.info("Fetching %s%s from the Hugging Face Hub (or its cache)", name, f" at {revision}" if revision else "")
    try:
        folder = snapshot_download(name, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
        # then the weights: with an index, only the files it names, not a second copy beside them
        indexed = os.path.isfile(os.path.join(folder, SAFETENSORS_INDEX))
        folder = snapshot_download(name, revision=revision, cache_dir=download_dir,
                                   allow_patterns=weight_files(folder) if indexed else ["*.safetensors"])
    except HFValidationError:
        raise ValueError(_no_folder(name)) from None
    except GatedRepoError:
        raise ValueError(f"{neither}: the repository is gated. Accept its terms on huggingface.co, then pass "
                         "--hf-token or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ValueError(f"{neither}: it has no revision {revision!r} (--revision)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{neither}: no such repository, or it is private (pass --hf-token or set HF_TOKEN). "
                         "For a local folder, check the path") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"{neither}: it is not in the Hub's cache{f' ({download_dir})' if download_dir else ''} "
                         "and the Hub cannot be reached (no network, or HF_HUB_OFFLINE is set)") from None
    except OSError as exc:   # the Hub's HTTP errors, a full disk, a cache that cannot be written
        raise ValueError(f"{neither}: {exc}") from None
    if not weight_files(folder):
        raise ValueError(f"The Hub repository {name!r} has no *.safetensors weights (nanoserve does not read "
                         ".bin or GGUF checkpoints); convert it, or pick a repository that has them")
    return folder


def _is_a_path(name: str) -> bool:
    """Whether `name` can only mean a local path: a Hub id is `name` or `owner/name`, never absolute,
    relative to `.` or `~`, nor an existing file."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or os.path.exists(name))


def _no_folder(name: str) -> str:
    what = "is a file, not a model folder" if os.path.isfile(name) else "does not exist"
    return (f"Model folder {name!r} {what}; pass a Hugging Face model folder (config.json, *.safetensors, "
            "tokenizer files), a Hub repository id such as Qwen/Qwen3-0.6B, or nothing for the bundled model")
