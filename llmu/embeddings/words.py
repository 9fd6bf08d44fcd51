"""Word lists and small helpers the embeddings notebook uses on SmolLM2's vocabulary.

A "word" here is one token. SmolLM2's BPE vocabulary stores most common English words with their
leading space (``" king"`` is token 4197, ``"king"`` another token), so the lists below keep it.
"""

from __future__ import annotations

import torch

from llmu.embeddings.reference import pca

__all__ = ["WORD_GROUPS", "token_id", "token_ids", "pca_figure", "neighbour_table"]

#: Groups of single-token words for the PCA picture, chosen so that each group clusters.
WORD_GROUPS: dict[str, list[str]] = {
    "royalty & people": [" king", " queen", " prince", " princess", " man", " woman", " boy", " girl"],
    "cities & countries": [" Paris", " London", " Berlin", " Tokyo", " France", " Germany", " Japan", " England"],
    "numbers": [" one", " two", " three", " four", " five", " six", " seven", " eight"],
    "colours": [" red", " blue", " green", " yellow", " purple", " orange", " black", " white"],
    "animals": [" dog", " cat", " horse", " cow", " puppy", " kitten", " bird", " fish"],
    "feelings": [" happy", " sad", " angry", " afraid", " excited", " calm", " proud", " lonely"],
    "weekdays": [" Monday", " Tuesday", " Wednesday", " Thursday", " Friday", " Saturday", " Sunday"],
}


def token_id(tokenizer, word: str) -> int:
    """The id of ``word`` when the tokenizer keeps it as a single token; ``ValueError`` otherwise."""
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.token_to_str(i) for i in ids]
        raise ValueError(f"{word!r} is not a single token: it splits into {pieces}")
    return ids[0]


def token_ids(tokenizer, words) -> tuple[list[str], list[int]]:
    """The words of ``words`` that are single tokens, and their ids (multi-token words are dropped)."""
    kept, ids = [], []
    for w in words:
        try:
            ids.append(token_id(tokenizer, w))
            kept.append(w)
        except ValueError:
            pass
    return kept, ids


def neighbour_table(words, scores: torch.Tensor, indices: torch.Tensor, tokenizer) -> list[str]:
    """One line per query word: its neighbours with their cosine similarity."""
    lines = []
    for w, s_row, i_row in zip(words, scores.tolist(), indices.tolist()):
        pairs = ", ".join(f"{tokenizer.token_to_str(i)!r} {s:.2f}" for s, i in zip(s_row, i_row))
        lines.append(f"{w!r:>14} -> {pairs}")
    return lines


def pca_figure(table: torch.Tensor, tokenizer, groups: dict[str, list[str]], title: str | None = None):
    """The chosen word groups' embedding rows, projected on their own first two principal axes."""
    from llmu.viz import scatter_text

    words, ids, colour = [], [], []
    for name, group in groups.items():
        kept, gids = token_ids(tokenizer, group)
        words += kept
        ids += gids
        colour += [name] * len(kept)
    if len(ids) < 3:
        raise ValueError("pick groups with at least 3 single-token words in all")
    p = pca(table[torch.tensor(ids)].detach(), 2)
    ev = p.explained.tolist()
    return scatter_text(
        p.coords[:, 0], p.coords[:, 1], [w.strip() for w in words], color=colour,
        title=title or f"PCA of {len(ids)} input embeddings (576 → 2 dimensions)",
        xlabel=f"PC 1 ({ev[0]:.0%} of the variance)", ylabel=f"PC 2 ({ev[1]:.0%})",
    )
