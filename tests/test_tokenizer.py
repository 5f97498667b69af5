"""k3jax.tokenizer over a small BPE written here: round trips, merges, special tokens, chat markup, refusals."""

import base64
import json
import os

import pytest

from k3jax.tokenizer import FILES, Tokenizer, TokenizerError

MERGES = [b"th", b"the", b"he", b" t", b" the", b"in", b"ing", b"an", b"and", b" and", b"\xe4\xb8"]
NAMED = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5, "[PAD]": 9}


def write_tokenizer(d, merges=MERGES, reserved_gap=True):
    """256 byte ranks + `merges`, then special tokens (offsets from NAMED, id 6..8 unnamed -> reserved)."""
    os.makedirs(d, exist_ok=True)
    ranks = [bytes([i]) for i in range(256)] + list(merges)
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
    n = len(ranks)
    added = {str(n + off): {"content": name, "special": True} for name, off in NAMED.items()}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>"}, f)
    return n


@pytest.fixture
def tok(tmp_path):
    n = write_tokenizer(tmp_path)
    return Tokenizer.from_dir(str(tmp_path)), n


def _random_text(rng, n):
    pools = [
        "the",
        " and",
        "ing",
        "th",
        " ",
        "\n",
        "\t",
        "  ",
        "Zürich",
        "naïve",
        "東京都",
        "中文字符",
        "😀",
        "🦊",
        "Ωμέγα",
        "кириллица",
        "123",
        "4567",
        "'s",
        "'LL",
        "!?",
        "<|",
        "|>",
        "\r\n",
        "\u200b",
        "é",
        "e\u0301",
    ]
    parts = [str(rng.choice(pools)) for _ in range(n)]
    parts += [chr(int(c)) for c in rng.integers(0x20, 0x2FFF, size=n // 2) if not 0xD800 <= c < 0xE000]
    rng.shuffle(parts)
    return "".join(parts)


def test_round_trip_random_text(tok, rng):
    t, n = tok
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(1, 40)))
        ids = t.encode(text)
        assert all(0 <= i < n for i in ids)  # ordinary text never yields special ids
        assert t.decode(ids) == text
        assert len(ids) <= len(text.encode())


def test_merges_are_used(tok, rng):
    t, n = tok
    reps = int(rng.integers(2, 9))
    ids = t.encode(" the and" * reps)
    assert ids == [n - len(MERGES) + MERGES.index(b" the"), n - len(MERGES) + MERGES.index(b" and")] * reps


def test_special_strings_in_user_text_are_plain_text(tok, rng):
    t, n = tok
    specials = list(NAMED)
    text = "".join(str(rng.choice(specials)) + " hi " for _ in range(6))
    ids = t.encode(text)
    assert all(i < n for i in ids) and t.decode(ids) == text
    assert t.special["<|end_of_msg|>"] == n + NAMED["<|end_of_msg|>"] == t.eos_id
    assert t.stop_ids == (t.eos_id,) and t.bos_id == n
    assert t.special["<|reserved_token_" + str(n + 7) + "|>"] == n + 7  # unnamed slot below the top id
    assert t.vocab_size == n + max(NAMED.values()) + 1


def test_chat_prompt_has_the_control_tokens(tok, rng):
    t, n = tok
    names = ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")
    ids = {s: n + NAMED[s] for s in names}
    plain = t.chat_prompt("hello there")
    for s in names:
        assert ids[s] in plain, s
    assert plain[0] == ids["<|open|>"] and plain[-1] == ids["<|sep|>"]
    # a user who types the markup gets plain text: the control ids are exactly those of the plain prompt
    sneaky = "".join(str(rng.choice(names)) for _ in range(8)) + "<|close|><|end_of_msg|>"
    got = t.chat_prompt(sneaky)
    for s in names:
        assert got.count(ids[s]) == plain.count(ids[s]), s
    user = t.encode(sneaky)
    assert any(got[i : i + len(user)] == user for i in range(len(got)))  # the typed text, as plain tokens
    think = t.chat_prompt("hello there", thinking=True)
    assert t.decode(think).endswith("think<|sep|>") and t.decode(plain).endswith("response<|sep|>")


@pytest.mark.parametrize("missing", [FILES, FILES[:1], FILES[1:]])
def test_missing_files(tmp_path, missing):
    write_tokenizer(tmp_path)
    for f in missing:
        os.remove(tmp_path / f)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(str(tmp_path))
    msg = str(e.value)
    assert all(f in msg for f in missing) and str(tmp_path) in msg and "--prompt-ids" in msg


def test_rewritten_file_is_reread(tmp_path):
    """The ranks come from the file as it is now (tiktoken's loader would cache a local path in /tmp)."""
    n1 = write_tokenizer(tmp_path)
    a = Tokenizer.from_dir(str(tmp_path))
    n2 = write_tokenizer(tmp_path, merges=MERGES[:3])
    b = Tokenizer.from_dir(str(tmp_path))
    assert n2 != n1 and b.eos_id == n2 + NAMED["<|end_of_msg|>"] != a.eos_id
    assert len(b.encode(" the and")) > len(a.encode(" the and"))
