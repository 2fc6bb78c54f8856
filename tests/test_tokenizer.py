"""The offline Qwen2.5-VL tokenizer must give the exact ids a real checkpoint was trained with."""

from __future__ import annotations

import base64
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import tiktoken

from dhp.dataflow import tokenizer as qtok
from dhp.dataflow.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    IMAGE_PAD_ID,
    IMAGE_PAD_TOKEN,
    VISION_END_ID,
    VISION_START_ID,
    load_tokenizer,
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dhp_cache")


@pytest.fixture(scope="session")
def tok(cache_dir: Path):
    return load_tokenizer(cache_dir=str(cache_dir))


@pytest.fixture(scope="session")
def reference() -> tiktoken.Encoding:
    lines = qtok.ranks_path().read_bytes().splitlines()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line)}
    return tiktoken.Encoding("qwen-ref", pat_str=qtok.PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens={})


HANDWRITTEN = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "'LLAMA 'STRANGE 'DOG 'Ts 'vex",
    "I'll go, you'd stay; they've left, we're here, it's DON'T and I'M and WE'LL.",
    "我爱自然语言处理。今天天气很好！",
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "한국어 문장도 있습니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵",
    "def f(x):\n\treturn x * 2\n\n\nclass A:\n    pass\n",
    "numbers 12345.678 and 3.14159, 1e-10, -42, 0x1F, 1,000,000",
    "    leading spaces",
    "trailing spaces     ",
    "\n\n\nleading newlines",
    "trailing newlines\n\n",
    "a  b   c    d     e",
    "tabs\tand\t\tmore\ttabs",
    "windows\r\nline\r\nendings\r\n",
    "mixed English 和中文 and 日本語 with numbers 2024年1月1日",
    "Ünïcödé àccénts: café, naïve, résumé, Straße",
    "Русский текст и العربية و עברית",
    '<html><body class="x">Hi &amp; bye</body></html>',
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "!!!???...,,,;;;:::",
    "$$$ %%% ^^^ &&& *** ((( ))) ___ +++",
    "  \n  \t  \n",
    "x" * 300,
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?q=1&r=two#frag",
    "αβγδε ΑΒΓΔΕ ∑∫∂√∞ ≤≥≠",
    "<|im_start|> is plain text to tiktoken's encode_ordinary but not here",
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r  ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年",
    "あいうえおかきくけこアイウエオカキクケコ",
    "😀😂🥲🎉🚀🌍❤️✨🔥👍",
    "éèêëàâäôöûüçñßøå",
    "'s 't 're 've 'm 'll 'd ",
]


def _texts() -> list[str]:
    rng = random.Random(1234)
    texts = [t for t in HANDWRITTEN if "<|" not in t]
    for a in HANDWRITTEN[:12]:
        for b in HANDWRITTEN[12:24]:
            texts.append(a + " " + b)
    while len(texts) < 400:
        pools = rng.sample(POOLS, k=rng.randint(1, 4))
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 80))))
    return [unicodedata.normalize("NFC", t) for t in texts]


def test_encoding_matches_tiktoken_and_roundtrips(tok, reference: tiktoken.Encoding) -> None:
    texts = _texts()
    assert len(texts) >= 300 and reference.encode_ordinary("12345.678") == [
        16,
        17,
        18,
        19,
        20,
        13,
        21,
        22,
        23,
    ]
    mismatches = [t for t in texts if tok.encode(t, add_special_tokens=False) != reference.encode_ordinary(t)]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"
    bad_roundtrip = [t for t in texts if tok.decode(tok.encode(t)) != t]
    assert not bad_roundtrip, bad_roundtrip[:3]


def test_known_qwen2_ids(tok) -> None:
    # Ids published with Qwen2 models, independent of the tiktoken reference above.
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("你好") == [108386]


def test_special_tokens(tok) -> None:
    expected = {
        "<|endoftext|>": ENDOFTEXT_ID,
        "<|im_start|>": IM_START_ID,
        "<|im_end|>": IM_END_ID,
        "<|vision_start|>": VISION_START_ID,
        "<|vision_end|>": VISION_END_ID,
        IMAGE_PAD_TOKEN: IMAGE_PAD_ID,
        "<|video_pad|>": 151656,
        "<tool_call>": 151657,
        "<|file_sep|>": 151664,
    }
    assert (ENDOFTEXT_ID, IM_START_ID, IM_END_ID) == (151643, 151644, 151645)
    assert (VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID) == (151652, 151653, 151655)
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tok) == 151665
    assert tok.pad_token_id == ENDOFTEXT_ID and tok.eos_token_id == IM_END_ID and tok.bos_token is None
    assert tok.padding_side == "right" and tok.model_max_length >= 32768
    ids = tok.encode("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>")
    assert ids == [VISION_START_ID, IMAGE_PAD_ID, IMAGE_PAD_ID, VISION_END_ID]
    # Non-special added tokens stay whole but survive skip_special_tokens.
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == 151657 and ids[-2:] == [151658, IM_END_ID]
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


SYS = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
VIS = "<|vision_start|><|image_pad|><|vision_end|>"


def test_chat_template_single_turn_image(tok) -> None:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
        {"role": "assistant", "content": "A red circle."},
    ]
    expected = f"{SYS}<|im_start|>user\n{VIS}Describe.<|im_end|>\n<|im_start|>assistant\nA red circle.<|im_end|>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == expected


def test_chat_template_multi_turn_two_images(tok) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "One cat."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": "Two dogs."},
    ]
    expected = (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        f"<|im_start|>user\nCompare {VIS}<|im_end|>\n"
        "<|im_start|>assistant\nOne cat.<|im_end|>\n"
        f"<|im_start|>user\n{VIS}And this?<|im_end|>\n"
        "<|im_start|>assistant\nTwo dogs.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(IMAGE_PAD_ID) == 2 and ids.count(IM_START_ID) == 5


def test_chat_template_generation_prompt(tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == f"{SYS}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


_LOAD_WITHOUT_BUILD = """
import sys
from dhp.dataflow import tokenizer as qtok
def no_build(*a, **k):
    raise SystemExit(3)
qtok.build_tokenizer = no_build
tok = qtok.load_tokenizer(cache_dir=sys.argv[1])
assert tok.convert_tokens_to_ids("<|image_pad|>") == 151655
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_second_process_loads_from_cache(tok, cache_dir: Path, tmp_path: Path) -> None:
    assert tok is load_tokenizer(cache_dir=str(cache_dir))  # in-process lru cache
    (folder,) = [p for p in cache_dir.iterdir()]
    assert folder.name.startswith(f"qwen2_5_vl_tokenizer-v{qtok.FORMAT_VERSION}-")
    assert (folder / "tokenizer.json").is_file()
    warm = _run(_LOAD_WITHOUT_BUILD, str(cache_dir))
    assert warm.returncode == 0, warm.stderr[-2000:]
    # Control: with an empty cache the same script must reach the (forbidden) build.
    cold = _run(_LOAD_WITHOUT_BUILD, str(tmp_path / "empty"))
    assert cold.returncode == 3, cold.stderr[-2000:]


@pytest.mark.slow  # a subprocess or a measured bench run
def test_concurrent_cold_builds_share_one_cache(tmp_path: Path) -> None:
    code = "import sys; from dhp.dataflow.tokenizer import load_tokenizer as L; print(len(L(None, sys.argv[1])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0] and outs == ["151665"] * 3
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1 and not entries[0].startswith("."), entries  # no temp dirs left behind
    assert _run(_LOAD_WITHOUT_BUILD, str(tmp_path)).returncode == 0


def test_load_from_local_directory(tok, tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    tok.save_pretrained(str(saved))
    local = load_tokenizer(path=str(saved))
    texts = _texts()[:100] + ["<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>"]
    assert [local.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert local.chat_template == tok.chat_template and len(local) == len(tok)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(path=str(empty))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(path=str(tmp_path / "missing"))
