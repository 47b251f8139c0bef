"""Pipeline layouts as Megatron-Core writes them (`--pipeline-model-parallel-layout`, plan field
`pp_layout`): which decoder layers, and where the embedding, the loss and the MTP layers sit, on
every virtual pipeline stage (docs/equations.md 9.4).

The string form is Megatron-Core's (megatron/core/transformer/pipeline_parallel_layer_layout.py,
`parse_str_to_list`): `E` the embedding, `t` a decoder layer, `m` an MTP layer, `L` the loss; `|`
ends a virtual stage; `(...)*N` repeats a group and `x*N` one symbol; commas are cosmetic. Virtual
stage k = c * pp + i is chunk c of pipeline rank i, so `Et*3|(tt|)*29,m|L` on pp 16 is vpp 2: rank
0 holds `Ettt` and `tt`, ranks 1-13 `tt` twice, rank 14 `tt` and `m`, rank 15 `tt` and `L`.
Megatron-Core's list form (one list of layer names per virtual stage: "embedding", "decoder",
"mtp", "loss", or their letters) comes in a TOML file (`load_layout_file`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from perfsim.errors import PerfsimError, did_you_mean

SYMBOLS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
LETTERS = {name: letter for letter, name in SYMBOLS.items()}
BOUNDARY = "|"
MOST_SYMBOLS = 2**20  # a layout written out in full: far beyond any model (1,000+ layers on 100+ stages)
MOST_DIGITS = 7  # a repeat count of up to 9,999,999 (more is beyond MOST_SYMBOLS anyway)
GRAMMAR = ("E embedding, t decoder layer, m MTP layer, L loss; | ends a virtual stage; (...)*N and x*N repeat; "
           "commas are ignored")


@dataclass(frozen=True)
class VirtualStage:
    """What one virtual pipeline stage (one chunk of one rank) holds."""

    layers: int  # decoder layers (t)
    embedding: int  # 1 if it holds the embedding (E)
    loss: int  # 1 if it holds the final norm, the output layer and the loss (L)
    mtp: int  # MTP layers (m)

    @property
    def symbols(self) -> str:
        return "E" * self.embedding + "t" * self.layers + "m" * self.mtp + "L" * self.loss


@dataclass(frozen=True)
class PipelineLayout:
    """A layout for `pp` pipeline ranks: `stages` in Megatron-Core's order (virtual stage k = c x pp
    + i is chunk c of rank i), so that `vpp` = len(stages) / pp."""

    pp: int
    stages: tuple  # VirtualStage per virtual stage

    @property
    def vpp(self) -> int:
        return len(self.stages) // self.pp

    def chunk(self, rank: int, chunk: int) -> VirtualStage:
        return self.stages[chunk * self.pp + rank]

    def rank(self, rank: int) -> tuple:
        """The chunks of pipeline rank `rank`, chunk 0 first."""
        return tuple(self.chunk(rank, c) for c in range(self.vpp))

    def rank_total(self, rank: int, what: str) -> int:
        """Decoder layers ("layers"), or embeddings, losses or MTP layers, of rank `rank`, all chunks."""
        return sum(getattr(s, what) for s in self.rank(rank))

    def total(self, what: str) -> int:
        return sum(getattr(s, what) for s in self.stages)

    def text(self) -> str:
        """The layout written out, virtual stages joined by |."""
        return BOUNDARY.join(s.symbols for s in self.stages)


def _count(text: str, body: str, at: int) -> tuple[int, int]:
    """The repeat count after the `*` at `at` of `body` (a part of the layout `text`): (count,
    index after it)."""
    end = at + 1
    while end < len(body) and body[end].isdigit():
        end += 1
    digits = body[at + 1:end]
    if not digits:
        raise PerfsimError(f"pipeline layout {_quote(text)}: a '*' needs a count after it "
                           f"(x*N or (...)*N; {GRAMMAR})")
    if len(digits) > MOST_DIGITS:
        raise PerfsimError(f"pipeline layout {_quote(text)}: the repeat count {digits[:12]}... is implausibly large "
                           f"(a layout holds at most {MOST_SYMBOLS:,} symbols)")
    return int(digits), end


def _quote(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:60] + "...")


def _expand_plain(text: str, body: str) -> str:
    """`body` (a part of the layout `text` without parentheses) with its x*N repeats written out."""
    out, i, size = [], 0, 0
    while i < len(body):
        ch = body[i]
        if ch not in SYMBOLS and ch != BOUNDARY:
            if ch == "*":
                raise PerfsimError(f"pipeline layout {_quote(text)}: a '*' follows nothing to repeat "
                                   f"(x*N or (...)*N; {GRAMMAR})")
            if ch in "()":
                raise PerfsimError(f"pipeline layout {_quote(text)}: unbalanced or nested parentheses "
                                   f"(Megatron-Core repeats one level of (...)*N; {GRAMMAR})")
            raise PerfsimError(f"pipeline layout {_quote(text)}: {ch!r} is not a layer ({GRAMMAR})")
        times = 1
        nxt = i + 1
        if nxt < len(body) and body[nxt] == "*":
            times, nxt = _count(text, body, nxt)
        size += times
        if size > MOST_SYMBOLS:
            raise PerfsimError(f"pipeline layout {_quote(text)} is longer than {MOST_SYMBOLS:,} symbols written out")
        out.append(ch * times)
        i = nxt
    return "".join(out)


def expand(text: str) -> str:
    """The layout string written out: commas dropped, every (...)*N and x*N repeated, as Megatron-Core
    does; a one-line PerfsimError for anything its grammar does not allow."""
    if not isinstance(text, str) or not text.strip():
        raise PerfsimError(f"pipeline layout {_quote(str(text))} is empty; write it as Megatron-Core does, "
                           f"e.g. Et*3|(tt|)*29,m|L ({GRAMMAR})")
    text = text.strip()
    plain = text.replace(",", "")
    out, i, size = [], 0, 0
    while i < len(plain):
        if plain[i] == "(":
            close = plain.find(")", i + 1)
            nested = plain.find("(", i + 1)
            if close < 0 or (0 <= nested < close):
                raise PerfsimError(f"pipeline layout {_quote(text)}: unbalanced or nested parentheses "
                                   f"(Megatron-Core repeats one level of (...)*N; {GRAMMAR})")
            if close + 1 >= len(plain) or plain[close + 1] != "*":
                raise PerfsimError(f"pipeline layout {_quote(text)}: a group in parentheses must be followed by *N, "
                                   f"e.g. (tt|)*29 ({GRAMMAR})")
            times, after = _count(text, plain, close + 1)
            if after < len(plain) and plain[after] == "*":
                raise PerfsimError(f"pipeline layout {_quote(text)}: a repeated group cannot be repeated again; "
                                   f"multiply the counts ({GRAMMAR})")
            body = _expand_plain(text, plain[i + 1:close])
            piece, i = body * times if len(body) * times <= MOST_SYMBOLS else None, after
        else:
            end = plain.find("(", i)
            end = len(plain) if end < 0 else end
            piece = _expand_plain(text, plain[i:end])
            i = end
        size += MOST_SYMBOLS + 1 if piece is None else len(piece)
        if size > MOST_SYMBOLS:
            raise PerfsimError(f"pipeline layout {_quote(text)} is longer than {MOST_SYMBOLS:,} symbols written out")
        out.append(piece)
    return "".join(out)


def virtual_stages(text: str) -> tuple:
    """(VirtualStages of a layout string in Megatron-Core's order, each one's symbols as written)."""
    parts = expand(text).split(BOUNDARY)
    return tuple(VirtualStage(layers=part.count("t"), embedding=part.count("E"), loss=part.count("L"),
                              mtp=part.count("m")) for part in parts), parts


@functools.lru_cache(maxsize=256)
def parse_layout(text: str, pp: int) -> PipelineLayout:
    """`text` laid over `pp` pipeline ranks, its order checked (`layout_problems` says every
    problem; this raises the first)."""
    problems = layout_problems(text, pp)
    if problems:
        raise PerfsimError(problems[0])
    return PipelineLayout(pp=pp, stages=virtual_stages(text)[0])


def layout_problems(text: str, pp: int, layers: int | None = None) -> list[str]:
    """Every reason `text` is not a layout Megatron-Core accepts for `pp` ranks (and a model of
    `layers` decoder layers, when given): its validate_layer_layout, in words."""
    try:
        stages, parts = virtual_stages(text)
    except PerfsimError as exc:
        return [str(exc)]
    name = f"pipeline layout {_quote(text.strip())}"
    if len(stages) % pp:
        return [f"{name} has {len(stages)} virtual stage{'s' * (len(stages) != 1)}, not a multiple of pp {pp} (each "
                f"pipeline rank holds the same number of chunks: vpp = virtual stages / pp)"]
    reasons = []
    flat = "".join(parts)
    if flat.count("E") != 1 or not flat.startswith("E") or not parts[0].startswith("E"):
        reasons.append(f"{name} must open with the embedding E, once, at the start of the first virtual stage "
                       f"(pipeline rank 0's first chunk)")
    if flat.count("L") != 1 or not flat.endswith("L") or not parts[-1].endswith("L"):
        reasons.append(f"{name} must end with the loss L, once, at the end of the last virtual stage "
                       f"(the last rank's last chunk)")
    if "m" in flat:
        if "t" in flat[flat.index("m"):]:
            reasons.append(f"{name} places a decoder layer t after an MTP layer m; the MTP layers come after every "
                           f"decoder layer")
        holding = [k for k, part in enumerate(parts) if "m" in part]
        vpp = len(stages) // pp
        if len(holding) > 1:
            reasons.append(f"{name} spreads its MTP layers over {len(holding)} virtual stages; Megatron-Core keeps "
                           f"them in one")
        elif holding[0] // pp != vpp - 1:
            reasons.append(f"{name} puts an MTP layer in chunk {holding[0] // pp + 1} of {vpp} of rank "
                           f"{holding[0] % pp}; Megatron-Core keeps MTP layers in a rank's last chunk")
    if layers is not None and flat.count("t") != layers:
        reasons.append(f"{name} places {flat.count('t')} decoder layer{'s' * (flat.count('t') != 1)} t; the model "
                       f"has {layers}")
    return reasons


def load_layout_file(path: str) -> str:
    """A layout from a TOML file: `layout = "Et*3|(tt|)*29,m|L"` (the string form), or `stages =
    [["embedding", "decoder"], ["decoder", "loss"]]` (Megatron-Core's list form, one list per
    virtual stage in its order; names or letters), at the top level or under [pp_layout]. Returns
    the layout as a string (the list form written out)."""
    from perfsim.spec._toml import read_toml

    data = read_toml(path, "pipeline layout file")
    if set(data) == {"pp_layout"} and isinstance(data["pp_layout"], dict):
        data = data["pp_layout"]
    known = ("layout", "stages")
    for key in data:
        if key not in known:
            raise PerfsimError(f"pipeline layout file {path}: unknown key {key!r}{did_you_mean(key, known)}; give "
                               f"layout = \"<Megatron-Core string>\" or stages = [[...], ...]")
    if len(data) != 1:
        raise PerfsimError(f"pipeline layout file {path}: give one of layout = \"<Megatron-Core string>\" or "
                           f"stages = [[...], ...]")
    if "layout" in data:
        if not isinstance(data["layout"], str):
            raise PerfsimError(f"pipeline layout file {path}: layout must be a string like \"Et*3|(tt|)*29,m|L\"")
        return data["layout"]
    stages = data["stages"]
    if not isinstance(stages, list) or not stages or not all(isinstance(s, list) for s in stages):
        raise PerfsimError(f"pipeline layout file {path}: stages must be a list of lists of layer names, one list per "
                           f"virtual stage, e.g. [[\"embedding\", \"decoder\"], [\"decoder\", \"loss\"]]")
    if sum(len(s) for s in stages) + len(stages) > MOST_SYMBOLS:
        raise PerfsimError(f"pipeline layout file {path}: more than {MOST_SYMBOLS:,} layers and stages")
    out = []
    for k, stage in enumerate(stages):
        letters = []
        for item in stage:
            word = item.strip().lower() if isinstance(item, str) else item
            letter = item.strip() if isinstance(item, str) and item.strip() in SYMBOLS else LETTERS.get(word)
            if letter is None:
                raise PerfsimError(f"pipeline layout file {path}: virtual stage {k} holds {item!r}, not a layer"
                                   f"{did_you_mean(word, list(LETTERS))} (embedding, decoder, mtp, loss, or E, t, m, L)")
            letters.append(letter)
        out.append("".join(letters))
    return BOUNDARY.join(out)
