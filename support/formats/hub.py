"""Where do the model and the data come from? A local path, or a Hugging Face Hub id.

`model` takes a directory or "owner/name"; `data` a file, a dataset "owner/name" (its training files) or
"owner/name/path/in/repo". An id goes through huggingface_hub's cache, fetching only what training reads; a local path
of the same name wins. Each failure is one line saying what to do.
"""

import fnmatch
import glob
import os
import re

from support.formats.atomic import read_json

SHARD_INDEX = "model.safetensors.index.json"
MODEL_FILES = ["config.json", SHARD_INDEX, "tokenizer*", "special_tokens_map.json", "chat_template.jinja"]
MODEL_FILES += ["generation_config.json"]  # then the weights: weight_files()
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
DATA_FILES = ["*.jsonl", "*.json", "*.parquet"]  # fnmatch's * spans folders too, as huggingface_hub matches them
TRAIN_FILES = ["*train*.jsonl", "*train*.json", "*train*.parquet"]
TRAIN_WORD = re.compile(r"(^|[/_.-])train([/_.-]|$)")  # train.jsonl, data/train-0.parquet, train/x.json
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/.+)?")  # owner/name, or owner/name/path/in/repo for a data file


def model_dir(spec, only_config=False) -> str:
    """The local directory of a model given as a path or a Hub id (only_config: just its config.json, for --plan)."""
    if os.path.isdir(spec):
        if HUB_ID.fullmatch(spec):
            print(f"model: {spec} is a directory here: using it, not the Hub repo of that name")
        return spec
    if not looks_like_hub_id(spec) or spec.count("/") != 1:
        raise FileNotFoundError(f"model: {spec}: no such directory (expected a model directory or a Hub id)")
    path = download("model", spec, ["config.json"] if only_config else MODEL_FILES)
    if not only_config and (weights := weight_files(path)):
        path = download("model", spec, weights)
    if not only_config and not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", SHARD_INDEX)):
        from huggingface_hub import constants

        if constants.is_offline_mode():  # a cache holding part of the repo, with no listing of the rest to tell
            raise FileNotFoundError(not_cached("model", spec, path))
        raise FileNotFoundError(
            f"model: {spec} has no safetensors weights on the Hub (no model.safetensors or {SHARD_INDEX}: .bin, .pth "
            "and other weight files are not read here); convert them, or give a local directory"
        )
    print(f"model: {spec} from the Hugging Face cache ({path})")
    return path


def weight_files(path) -> list[str]:
    """The shards the index names, else model.safetensors; none for an index without a weight_map (hf.Checkpoint
    then says so)."""
    if not os.path.isfile(index := os.path.join(path, SHARD_INDEX)):
        return ["model.safetensors"]
    contents = read_json(index)
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    return sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []


def data_files(spec) -> list[str]:
    """The local files of a dataset given as a path, a Hub dataset id (the files whose path says "train" if any, else
    all its data files) or a Hub id and a file in it."""
    if os.path.exists(spec):
        if HUB_ID.fullmatch(spec):
            print(f"data: {spec} is a file here: using it, not the Hub dataset of that name")
        return [spec]
    if not looks_like_hub_id(spec) or spec.count("/") == 1 and spec.endswith(DATA_SUFFIXES):
        raise FileNotFoundError(f"data: {spec}: no such file (expected a data file or a Hub dataset id)")
    owner, name, *inside = spec.split("/")
    for patterns in [["/".join(inside)]] if inside else (TRAIN_FILES, DATA_FILES):
        path = download("data", f"{owner}/{name}", patterns)
        found = glob.glob(os.path.join(path, "**", "*"), recursive=True)  # the snapshot: what this call and earlier
        rel = sorted(os.path.relpath(f, path) for f in found if os.path.isfile(f))  # ones fetched; ours match
        rel = [f for f in rel if any(fnmatch.fnmatch(f, p) for p in patterns)]
        rel = [f for f in rel if TRAIN_WORD.search(f)] if patterns is TRAIN_FILES else rel  # not "unconstrained"
        if rel:
            print(f"data: {spec} from the Hugging Face cache ({', '.join(rel)})")
            return [os.path.join(path, f) for f in rel]
    raise FileNotFoundError(f"data: {spec} holds no such file" if inside else f"data: {spec} holds no data file")


def looks_like_hub_id(spec) -> bool:
    """owner/name[/path], whose owner is no folder here (a missing checkpoints/X is never sent to the Hub)."""
    return bool(HUB_ID.fullmatch(spec)) and not os.path.exists(spec.split("/")[0])


def download(key, repo, patterns) -> str:
    """snapshot_download of `repo` (a dataset repo when key is "data"), with each failure one line naming `key`."""
    from huggingface_hub import errors, snapshot_download

    kind = "dataset" if key == "data" else "model"
    try:
        return snapshot_download(repo, repo_type=kind, allow_patterns=patterns)
    except errors.GatedRepoError:
        raise PermissionError(
            f"{key}: {repo} is gated: accept its licence on https://huggingface.co/{'datasets/' * (kind == 'dataset')}"
            f"{repo}, then log in with `hf auth login` (or set HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{key}: {repo} is not a {kind} on the Hugging Face Hub, or it is private: log in with `hf auth login`, "
            "or give a local path"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # huggingface_hub's IncompleteSnapshotError names the partial snapshot
        raise FileNotFoundError(not_cached(key, repo, getattr(e, "snapshot_path", None))) from None
    except errors.HfHubHTTPError as e:
        raise OSError(f"{key}: {repo}: {str(e).strip().splitlines()[0]}") from None
    except errors.HFValidationError as e:  # a name the Hub cannot hold ("a/b--c")
        raise ValueError(f"{key}: {repo} is neither a local path nor a valid Hub id ({e})") from None


def not_cached(key, repo, snapshot=None) -> str:
    """The line for an unreachable repo whose files the cache lacks: all of them, or (given the snapshot folder) some,
    as after --plan, which fetches config.json alone."""
    from huggingface_hub import constants

    offline = " (HF_HUB_OFFLINE is set)" if constants.is_offline_mode() else ""
    get = f"hf download {repo}" + (" --repo-type dataset" if key == "data" else "")
    what = f"{key}: {repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if snapshot is not None:
        found = glob.glob(os.path.join(snapshot, "**", "*"), recursive=True)
        held = sorted(os.path.relpath(f, snapshot) for f in found if os.path.isfile(f))
        weights = key == "model" and not fnmatch.filter(held, "*.safetensors")
        missing = "its weights were" if weights else "some of it was"
        what = f"{key}: {repo}: {missing} never downloaded (the Hugging Face cache holds only {', '.join(held)} of it)"
    return f"{what} and the Hub cannot be reached{offline}; run `{get}` where there is a network, or give a local path"
