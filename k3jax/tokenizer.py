"""The K3 tokenizer: tiktoken BPE from a checkpoint's `tiktoken.model` + `tokenizer_config.json` (docs/model.md §8.2).

Special tokens come from `added_tokens_decoder` (unnamed slots above the BPE ranks become
`<|reserved_token_{id}|>`). User text is always encoded with special tokens DISALLOWED as control tokens (a
user typing `<|end_of_msg|>` gets ordinary text), while the chat markup uses the special ids directly.
The demo model's tokenizer is the same class over a byte-level BPE (256 single-byte ranks plus a few merges).
"""

from __future__ import annotations

import base64
import json
import os

import tiktoken

FILES = ("tiktoken.model", "tokenizer_config.json")

# Kimi's pre-tokeniser (docs/model.md §8.2: 8 branches, Han runs first, cased words, 1-3 digits, punctuation, spaces)
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class TokenizerError(ValueError):
    pass


def _read_ranks(path: str) -> dict[bytes, int]:
    """`base64-token rank` lines. Not tiktoken.load_tiktoken_bpe: it caches local files by PATH in
    /tmp/data-gym-cache, so a re-converted checkpoint (or the demo remade in place) would get stale ranks."""
    with open(path, "rb") as f:
        return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}


class Tokenizer:
    def __init__(self, model_path: str, config_path: str):
        ranks = _read_ranks(model_path)
        with open(config_path) as f:
            conf = json.load(f)
        added = {int(i): v["content"] for i, v in conf.get("added_tokens_decoder", {}).items()}
        n = len(ranks)
        top = max([n - 1, *added]) if added else n - 1
        self.special = {added.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, top + 1)}
        self.enc = tiktoken.Encoding(name="k3", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self.special)
        self.eos_id = self.special.get(conf.get("eos_token", "<|end_of_msg|>"), self.special.get("<|end_of_msg|>"))
        self.bos_id = self.special.get(conf.get("bos_token", "[BOS]"))
        self.stop_ids = tuple(i for i in (self.eos_id,) if i is not None)

    @classmethod
    def from_dir(cls, d: str) -> Tokenizer:
        paths = [os.path.join(d, f) for f in FILES]
        missing = [f for f, p in zip(FILES, paths, strict=True) if not os.path.exists(p)]
        if missing:
            raise TokenizerError(
                f"{d} has no tokenizer files ({', '.join(missing)} missing): pass token ids with --prompt-ids, "
                "or convert from an HF directory that has tiktoken.model and tokenizer_config.json"
            )
        return cls(*paths)

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        """Ordinary text: special-token strings are encoded as plain text, never as control tokens."""
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.enc.n_vocab], errors="replace")

    def chat_prompt(self, user_text: str, thinking: bool = False) -> list[int]:
        """One user turn and the assistant generation prompt in K3's XTML markup (docs/model.md §8.3)."""
        o, c, s, eom = (self.special[t] for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
        ids = [
            o,
            *self.encode('message role="user"'),
            s,
            *self.encode(user_text),
            c,
            *self.encode("message"),
            s,
            eom,
            o,
            *self.encode('message role="assistant"'),
            s,
            o,
        ]
        return ids + self.encode("think" if thinking else "response") + [s]
