"""Which texts repeat an earlier one: exact duplicates, or near-duplicates by MinHash LSH.

One function, `duplicate_of`, serves two callers: the `dedup` task operator
(rft/data/task_operators.py), which drops repeated prompts before a stage, and the explorer, which
drops repeated sampled responses. Both run on every rank and must agree, so the result depends only
on the texts and the arguments: no unseeded randomness, no iteration over sets of strings (whose
order follows Python's per-process salted `hash()`), and MinHash's permutations come from
`numpy.random.RandomState(seed)` with the SHA-1 based default hash, which are the same in every
process and on every machine.

Normalisation (lowercase, whitespace runs collapsed to one space, stripped) is applied before
either comparison, so "What is 2+3?" and "what  is 2+3? " are exact duplicates.

Near-duplicates compare sets of *character* shingles (every `shingle`-long substring of the
normalised text), not word shingles. Tasksets are mostly short prompts (a math question is 10-30
words): a 3-word shingle set of such a prompt has only a handful of elements and one edited word
removes three of them, so the Jaccard estimate jumps in coarse steps; character shingles give
tens to hundreds of elements, degrade gracefully with small edits (a spacing or punctuation change
touches two or three shingles) and need no tokeniser for languages without spaces.

A caveat the threshold decides: character similarity cannot tell a reworded copy from a problem
with different numbers. "Natalia sold 48 clips ..." and "Natalia sold 72 clips ..." are ~0.9
similar although their answers differ; at threshold 0.8 the second is a duplicate. Use 1.0 (exact)
where every number matters, and below 1.0 to remove templated near-copies.
"""

from __future__ import annotations

from collections.abc import Sequence

_LSH_HINT = {  # smallest num_perm datasketch's LSH accepts at these thresholds (>= 2 bands)
    0.95: 64, 0.97: 128, 0.99: 512,
}


def normalise(text: str) -> str:
    """Lowercase, collapse whitespace runs to one space, strip: the form that is compared."""
    return " ".join(text.lower().split())


def _shingles(text: str, k: int) -> list[bytes]:
    """The distinct character k-grams of `text`, as UTF-8 bytes (MinHash's default hash takes
    bytes), in order of first occurrence: a dict keeps them unique without set iteration order."""
    return list(dict.fromkeys(text[i : i + k].encode("utf-8") for i in range(len(text) - k + 1)))


def _check_arguments(texts: Sequence[str], threshold: float, num_perm: int, shingle: int) -> None:
    """ValueError naming the bad argument and the fix; TypeError for a text that is not a str."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold!r} must be a number in (0, 1]: 1.0 finds exact duplicates "
                         "(after normalising case and whitespace), e.g. 0.8 near-duplicates")
    if isinstance(num_perm, bool) or not isinstance(num_perm, int) or num_perm < 2:
        raise ValueError(f"num_perm={num_perm!r} must be an integer >= 2 (MinHash permutations; 128 is usual)")
    if isinstance(shingle, bool) or not isinstance(shingle, int) or shingle < 1:
        raise ValueError(f"shingle={shingle!r} must be a positive integer (characters per shingle; 3 is usual)")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a str; pass text only "
                            "(callers decide what a missing text means)")


def _lsh(threshold: float, num_perm: int):
    """A MinHashLSH index, or ValueError when the threshold is too high for `num_perm`: datasketch
    then finds fewer than 2 bands and refuses, and a silent fallback would miss duplicates."""
    from datasketch import MinHashLSH

    try:
        return MinHashLSH(threshold=threshold, num_perm=num_perm)
    except ValueError as err:
        hint = next((n for t, n in sorted(_LSH_HINT.items()) if threshold <= t), None)
        fix = f"raise num_perm (>= {hint} works at {threshold})" if hint else "use threshold=1.0 (exact)"
        raise ValueError(f"threshold={threshold} with num_perm={num_perm}: MinHash LSH cannot be built "
                         f"({err}); {fix}, or lower the threshold") from None


def duplicate_of(texts: list[str], threshold: float = 1.0, num_perm: int = 128, shingle: int = 3,
                 seed: int = 1) -> list[int | None]:
    """For each text, the index of an earlier text it duplicates, or None if it is the first of
    its kind. The index returned is always of a first-of-its-kind text (its own entry is None), so
    keeping the texts whose entry is None keeps one text per group.

    threshold == 1.0: exact duplicates of the normalised text. threshold < 1.0: additionally,
    near-duplicates: a text duplicates the earliest kept text whose estimated Jaccard similarity
    (`MinHash.jaccard` over character `shingle`-grams, `num_perm` permutations, `seed`) is >=
    threshold among the candidates MinHash LSH returns. LSH is approximate: pairs just above the
    threshold can be missed, and pairs just below it counted, by a few hundredths (the estimate's
    standard error is about sqrt(J (1 - J) / num_perm)). Only first-of-their-kind texts enter the
    index, so a chain of small edits (A ~ B ~ C, A not ~ C) cannot walk a group arbitrarily far.
    Texts whose normalised form is shorter than `shingle` have no shingles; they are compared
    exactly only. Exact duplicates are always duplicates, at any threshold.
    """
    _check_arguments(texts, threshold, num_perm, shingle)
    normalised = [normalise(t) for t in texts]
    out: list[int | None] = [None] * len(texts)
    first: dict[str, int] = {}  # normalised text -> the first-of-its-kind index it maps to
    if threshold == 1.0:
        for i, norm in enumerate(normalised):
            if norm in first:
                out[i] = first[norm]
            else:
                first[norm] = i
        return out

    from datasketch import MinHash

    index = _lsh(threshold, num_perm)  # first: a bad threshold/num_perm pair fails before any hashing
    # Hash only what needs a sketch: texts long enough and not an exact repeat of an earlier one.
    todo = _first_long(normalised, shingle)
    sketches = dict(zip(todo, MinHash.bulk((_shingles(normalised[i], shingle) for i in todo),
                                           num_perm=num_perm, seed=seed)))
    for i, norm in enumerate(normalised):
        if norm in first:
            out[i] = first[norm]
            continue
        sketch = sketches.get(i)
        if sketch is None:  # too short to shingle: an exact comparison only
            first[norm] = i
            continue
        # query() returns a list built from a set of int keys; sort so "earliest" is explicit.
        match = next((j for j in sorted(index.query(sketch)) if sketches[j].jaccard(sketch) >= threshold), None)
        if match is not None:
            out[i] = first[norm] = match
        else:
            first[norm] = i
            index.insert(i, sketch, check_duplication=False)
    return out


def _first_long(normalised: list[str], shingle: int) -> list[int]:
    """Indices of the texts that are the first occurrence of their normalised form and at least
    `shingle` characters long: the only ones that need a MinHash."""
    seen: dict[str, None] = {}
    todo = []
    for i, norm in enumerate(normalised):
        if norm not in seen:
            seen[norm] = None
            if len(norm) >= shingle:
                todo.append(i)
    return todo
