"""Hand-written tokenizers for tiny models, built offline.

`write_clip_tokenizer` writes a CLIP byte-level BPE vocabulary (`vocab.json` +
`merges.txt`) in which every given word is exactly one token, and
`write_t5_tokenizer` a T5 unigram tokenizer in which every given word is one
piece. Both save the tokenizer with `save_pretrained(folder)` so that
`from_pretrained(folder)` reloads it identically, with nothing fetched from a
hub.
"""
from __future__ import annotations

import json
import pathlib
import string
from collections.abc import Iterable, Sequence

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
EOW = "</w>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode character table."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_B2U = _bytes_to_unicode()


def _symbols(word: str, end_of_word: str = EOW) -> list[str]:
    """The initial BPE symbols of a pre-tokenized word (byte-level, the last with CLIP's
    </w>; GPT-2-style byte-level BPE, as Qwen2's, has no end-of-word suffix: "")."""
    chars = [_B2U[b] for b in word.encode("utf-8")]
    return chars[:-1] + [chars[-1] + end_of_word]


def _bpe(word: str, ranks: dict[tuple[str, str], int], end_of_word: str = EOW) -> list[str]:
    """Apply BPE merges as CLIP (and `tokenizers`' BPE model) does: lowest rank first."""
    parts = _symbols(word, end_of_word)
    while len(parts) > 1:
        best = min(range(len(parts) - 1),
                   key=lambda i: ranks.get((parts[i], parts[i + 1]), float("inf")))
        pair = (parts[best], parts[best + 1])
        if pair not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def _chain(word: str, end_of_word: str = EOW) -> list[tuple[str, str]]:
    """Merges that build `word` left to right: ('r','e'), ('re','d</w>')."""
    syms = _symbols(word, end_of_word)
    out, acc = [], syms[0]
    for s in syms[1:]:
        out.append((acc, s))
        acc = acc + s
    return out


def _order_merges(words: Sequence[str], end_of_word: str = EOW) -> list[tuple[str, str]]:
    """Merge list in which each word BPE-encodes to one symbol.

    Words are chained left to right; a word whose chain is broken by another
    word's merges (a pair inside it merged first) is moved to the front, since
    a word whose merges rank before all others always encodes whole.
    """
    order = list(words)
    for _ in range(len(order) ** 2 + 1):
        merges: list[tuple[str, str]] = []
        seen = set()
        for w in order:
            for m in _chain(w, end_of_word):
                if m not in seen:
                    seen.add(m)
                    merges.append(m)
        ranks = {m: i for i, m in enumerate(merges)}
        bad = [w for w in order if len(_bpe(w, ranks, end_of_word)) != 1]
        if not bad:
            return merges
        order.remove(bad[-1])
        order.insert(0, bad[-1])
    raise ValueError(f"cannot build BPE merges making each of {list(words)} one token")


def _normalize_words(words: Iterable[str], lower: bool = True) -> list[str]:
    out: list[str] = []
    for w in words:
        w = w.strip()
        if lower:
            w = w.lower()  # the CLIP normalizer lowercases; T5 keeps case
        if not w or any(c.isspace() for c in w):
            raise ValueError(f"vocabulary word {w!r} must be non-empty and have no whitespace")
        if w not in out:
            out.append(w)
    return out


def write_clip_tokenizer(folder, words, model_max_length=16, *, pad_token=EOS):
    """Write a tiny CLIP byte-level BPE tokenizer to `folder` and return it.

    `vocab.json` holds, in CLIP's order, the 256 byte-level characters ("!" is
    id 0), the same with '</w>', the merged tokens, then `<|startoftext|>` and
    `<|endoftext|>` (so the vocabulary size is 514 + the number of merges);
    `merges.txt` builds each word from its characters (e.g. `r e`, `re d</w>`),
    so each word of `words` is exactly one token and any other text still
    tokenizes, byte by byte, with no unknown token.
    `pad_token` is `<|endoftext|>` as in SD's tokenizer, or `"!"` as in SD3's
    second (OpenCLIP bigG) tokenizer, where "!" is id 0.

    Words must each be one pre-token of CLIP's splitter (a run of letters, a
    single digit or a run of punctuation); they are lowercased.
    """
    from transformers import CLIPTokenizer

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = _normalize_words(words)

    base_sorted = list(_B2U.values())  # all 256 bytes, as CLIP: nothing is ever unknown

    vocab: dict[str, int] = {}
    for tok in base_sorted + [c + EOW for c in base_sorted]:
        vocab.setdefault(tok, len(vocab))
    merges = _order_merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    if pad_token not in vocab:
        raise ValueError(f"pad token {pad_token!r} not in the vocabulary")

    with open(folder / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, indent=1)
    with open(folder / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")

    tok = CLIPTokenizer(
        vocab_file=str(folder / "vocab.json"),
        merges_file=str(folder / "merges.txt"),
        vocab=str(folder / "vocab.json"),
        merges=str(folder / "merges.txt"),
        model_max_length=model_max_length,
        pad_token=pad_token,
        unk_token=EOS,
        bos_token=BOS,
        eos_token=EOS,
    )
    tok.save_pretrained(str(folder))
    tok = CLIPTokenizer.from_pretrained(str(folder))
    _check_one_token_each(tok, words, "CLIP")
    return tok


def _check_one_token_each(tok, words, kind):
    bad = {w: tok.tokenize(w) for w in words if len(tok.tokenize(w)) != 1}
    if bad:
        raise ValueError(f"{kind} tokenizer splits vocabulary words: {bad}")


def write_t5_tokenizer(folder, words, *, model_max_length=32):
    """Write a tiny T5 unigram tokenizer to `folder` and return it.

    The vocabulary is `<pad>` (0), `</s>` (1), `<unk>` (2), the word-start
    marker `▁`, each word as `▁word`, then a-z and 0-9 both as `▁c` and `c`
    (so unknown words still split into letters) — scored so that a whole word
    always beats its letters. No sentinel `<extra_id_N>` tokens.
    """
    from transformers import T5Tokenizer

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = _normalize_words(words, lower=False)

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    seen = {p for p, _ in pieces}
    for w in words:
        p = "▁" + w
        if p not in seen:
            seen.add(p)
            pieces.append((p, -1.0))
    for c in string.ascii_lowercase + string.digits:
        for p in ("▁" + c, c):
            if p not in seen:
                seen.add(p)
                pieces.append((p, -5.0))

    tok = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    tok.save_pretrained(str(folder))
    tok = T5Tokenizer.from_pretrained(str(folder))
    _check_one_token_each(tok, words, "T5")
    return tok


#: Qwen2's special tokens: the chat template's turn markers, the padding / end of text
#: token, and Qwen2.5-VL's vision markers (the processor's image placeholder).
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>")


def write_qwen2_tokenizer(folder, words, *, model_max_length: int = 2048):
    """Write a tiny Qwen2 byte-level BPE tokenizer (`Qwen2Tokenizer`, transformers' own
    class and pre-tokenizer) to `folder` and return it.

    `vocab.json` holds the 256 byte-level characters, then the merged tokens, so that
    every word of `words` is exactly one token both at the start of a text and after a
    space (`word` and `Ġword`, as GPT-2-style vocabularies hold both), then the special
    tokens `QWEN_SPECIAL`. Any other text still tokenizes, byte by byte. Words keep their
    case (Qwen2 does not lowercase) and must be one pre-token each: a run of letters.
    """
    from transformers import Qwen2Tokenizer

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = _normalize_words(words, lower=False)
    pieces = [p for w in words for p in (w, " " + w)]
    merges = _order_merges(pieces, end_of_word="")
    vocab: dict[str, int] = {}
    for tok in _B2U.values():
        vocab.setdefault(tok, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for tok in QWEN_SPECIAL:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m) for m in merges], model_max_length=model_max_length,
                         additional_special_tokens=list(QWEN_SPECIAL[1:]))
    tok.save_pretrained(str(folder))
    tok = Qwen2Tokenizer.from_pretrained(str(folder))
    bad = {p: tok.tokenize(p) for p in pieces if len(tok.tokenize(p)) != 1}
    if bad:
        raise ValueError(f"Qwen2 tokenizer splits vocabulary words: {bad}")
    return tok


__all__ = ["write_clip_tokenizer", "write_t5_tokenizer", "write_qwen2_tokenizer"]
