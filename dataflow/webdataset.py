"""img2dataset WebDataset shards -> one-image conversation records: what `split_records` is for JSONL.

A shard is a tar of samples: `{key}.jpg` (or .jpeg/.png/.webp; or a video: .mp4/.webm/.mkv/.avi/.mov), `{key}.txt`
(the caption img2dataset chose) and `{key}.json` (every other column: LAION-POP's `cogvlm_caption`,
`llava_caption`, url, ...).
A sample's members are consecutive in the tar (img2dataset and webdataset's writers keep them together),
so a shard streams member by member from its object, one sample at a time.

Each sample becomes the row the preprocessor takes (`Preprocessor.__call__`): `source` "shard:key", `record`
a LLaVA-style conversation, [user: `data.webdataset.prompt` (holds <image> once), assistant: the caption],
`image` the image member's bytes; a sample whose member is a video instead gets `<video>` in the prompt's `<image>`
place and `video` the member's bytes (decoded, sampled and patchified in the preprocessor: dataflow/video.py).
A sample that cannot become one is a row with `skip` = "reason\\tdetail",
which the preprocessor turns into a counted skip (quarantine.jsonl, summary.json) like a bad JSONL line:

    missing_shard          the shard object does not exist (a failed img2dataset shard)
    unreadable_shard       it exists but cannot be read (permissions, a storage error past the retries)
    truncated_tar          the tar ends mid-member or is not a tar: the samples before it are kept
    missing_image          a key without an image or video member
    missing_caption        no `.txt` member / no such field in the `.json` member (or the .json is not JSON)
    empty_caption          a caption of only whitespace
    special_token_caption  a caption holding a chat-template token (`<|im_end|>`, ...) or `<image>`

(A corrupt or truncated JPEG is found where the image is decoded: `corrupt_image`, as for JSONL; an undecodable
video: `corrupt_video`.)
Shuffle and data-parallel split: the shards' order is permuted with the epoch's seed (`sources.WebDataset`), each
shard's samples with it too (`positions.own_rows`). Data-parallel streams are dealt whole shards (each byte is
fetched once in all) when there are at least 2 per stream, else each keeps every N-th sample of every shard
(`positions.reads`).
"""

from __future__ import annotations

import json
import re
import tarfile
from typing import Any

from dhp.dataflow.positions import own_rows
from dhp.dataflow.video import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
SPECIAL_TOKEN = re.compile(r"<\|[^|<>]+\|>|<image>")


def _row(source: str, record: str = "", image: bytes = b"", skip: str = "", video: bytes = b"") -> dict[str, Any]:
    return {"source": source, "record": record, "image": image, "video": video, "skip": skip}


def _skip(source: str, reason: str, detail: str) -> dict[str, Any]:
    return _row(source, skip=f"{reason}\t{detail}")


def caption_of(members: dict[str, bytes], field: str) -> tuple[str | None, str]:
    """(caption, why it is missing): the `.txt` member for field "txt", else `field` of the `.json` member."""
    if field == "txt":
        if "txt" not in members:
            return None, "no .txt member"
        return members["txt"].decode("utf-8", errors="replace"), ""
    if "json" not in members:
        return None, f"no .json member (data.webdataset.caption={field})"
    try:
        meta = json.loads(members["json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f".json member is not JSON: {e}"
    value = meta.get(field) if isinstance(meta, dict) else None
    if not isinstance(value, str):
        return None, f".json has no string field {field!r}"
    return value, ""


def sample_row(shard: str, key: str, members: dict[str, bytes], prompt: str, caption_field: str) -> dict[str, Any]:
    """One sample's members (extension -> bytes) -> its preprocessor row, or a skip row naming `shard:key`."""
    source = f"{shard}:{key}"
    ext = next((e for e in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS if e in members), None)
    if ext is None:
        kinds = "/".join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
        return _skip(source, "missing_image", f"no {kinds} member (has {sorted(members)})")
    caption, why = caption_of(members, caption_field)
    if caption is None:
        return _skip(source, "missing_caption", why)
    if not caption.strip():
        return _skip(source, "empty_caption", f"caption {caption!r}")
    special = SPECIAL_TOKEN.search(caption)
    if special:
        return _skip(source, "special_token_caption", f"caption holds {special.group()!r}")
    if ext in VIDEO_EXTENSIONS:
        record = {
            "id": key,
            "video": f"{key}.{ext}",
            "conversations": [
                {"from": "human", "value": prompt.replace("<image>", "<video>")},
                {"from": "gpt", "value": caption.strip()},
            ],
        }
        return _row(source, json.dumps(record), video=members[ext])
    record = {
        "id": key,
        "image": f"{key}.{ext}",
        "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": caption.strip()}],
    }
    return _row(source, json.dumps(record), members[ext])


def _split_name(name: str) -> tuple[str, str]:
    """'dir/000001.jpg' -> ('dir/000001', 'jpg'): webdataset's key is everything before the first dot of the
    file name."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def shard_rows(fs: Any, path: str, source: str, prompt: str, caption_field: str) -> list[dict[str, Any]]:
    """Every sample of one shard, in tar order (module docstring), read through `fs` (pyarrow)."""
    try:
        stream = fs.open_input_stream(path)
    except FileNotFoundError:
        return [_skip(source, "missing_shard", f"{source}: not found")]
    except OSError as e:
        return [_skip(source, "unreadable_shard", f"{source}: {str(e).splitlines()[0] if str(e) else e!r}")]
    rows: list[dict[str, Any]] = []
    key, members = None, {}
    try:
        with stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                k, ext = _split_name(info.name)
                if k != key and key is not None:
                    rows.append(sample_row(source, key, members, prompt, caption_field))
                    members = {}
                key = k
                members[ext] = tar.extractfile(info).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        # the sample being read when the tar broke is incomplete: dropped with the reason, the rest kept
        where = f"{source}:{key}" if key is not None else source
        return rows + [_skip(where, "truncated_tar", f"{where}: {e}")]
    if key is not None:
        rows.append(sample_row(source, key, members, prompt, caption_field))
    return rows


def split_shard(
    row: dict[str, Any], fs: Any, prompt: str, caption: str, seed: int | None, prefix: str = ""
) -> list[dict[str, Any]]:
    """Ray Data map: one `positions.Read` row of a shard (`path` as `fs` names it) -> the read's sample rows."""
    return own_rows(shard_rows(fs, row["path"], prefix + row["path"], prompt, caption), row, seed)
