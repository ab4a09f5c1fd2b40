"""The per-layer precision map: which projections of which decoder layers run in fp8, in
`fp8.other_dtype`, or in float32 (the `fp8.layers` field, and what `fp8.select=auto` writes).

The one idea: one code per projection, in `fp8.matmuls` order, one word per layer, words joined
by commas: with matmuls "q,k,v,o,gate,up,down", "8888888,8888oo8" keeps layer 1's gate and up in
other_dtype. Codes: `8` fp8, `o` fp8.other_dtype, `f` float32. docs/precision.md.
"""

from __future__ import annotations

from dsjax.errors import ConfigError

FP8, OTHER, FLOAT32 = "8", "o", "f"
CODES = {FP8: "fp8", OTHER: "other_dtype", FLOAT32: "float32"}

# One layer's choice: (projections in fp8, projections in float32); the rest run in other_dtype.
Choice = tuple[tuple[str, ...], tuple[str, ...]]


def parse(text: str, matmuls: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The map's words, one per layer, each checked; () for "" (no map: fp8.matmuls and
    keep_*_layers decide). A bad map is one ConfigError naming the word."""
    if not text.strip():
        return ()
    words = tuple(w.strip() for w in text.split(","))
    if len(words) != num_layers:
        raise ConfigError(f"fp8.layers: {len(words)} layer words for model.num_layers "
                          f"{num_layers} (one word per layer, comma-separated)")
    for i, word in enumerate(words):
        if len(word) != len(matmuls) or set(word) - set(CODES):
            raise ConfigError(
                f"fp8.layers: layer {i}'s word {word!r} must have one code per projection of "
                f"fp8.matmuls ({','.join(matmuls)}: {len(matmuls)} codes), each one of "
                f"{', '.join(f'{c} ({n})' for c, n in CODES.items())}")
    return words


def choice(word: str, matmuls: tuple[str, ...]) -> Choice:
    """(fp8 projections, float32 projections) of one layer's word."""
    return (tuple(m for m, c in zip(matmuls, word) if c == FP8),
            tuple(m for m, c in zip(matmuls, word) if c == FLOAT32))


def word(fp8: tuple[str, ...], float32: tuple[str, ...], matmuls: tuple[str, ...]) -> str:
    """The word of one layer's choice (`choice`'s inverse)."""
    return "".join(FP8 if m in fp8 else FLOAT32 if m in float32 else OTHER for m in matmuls)


def uniform(matmuls: tuple[str, ...], flags: tuple[bool, ...]) -> tuple[str, ...]:
    """The map of fp8.matmuls in the layers whose flag is set, other_dtype elsewhere."""
    return tuple((FP8 if on else OTHER) * len(matmuls) for on in flags)
