"""A picture of the block manager at work: block tables on the left, the pool of blocks on the right.

:func:`scenario` drives the real :class:`llmu.paged.BlockManager` through a short story and records
what it looks like after every event (an :class:`Event`: a caption, the manager's
``snapshot()``, each sequence's length and tokens, and the copies copy-on-write asked for):

1. request A arrives; its full prompt blocks are registered in the prefix cache;
2. request B starts with the same system prompt and shares A's first blocks (prefix caching);
3. A grows token by token and takes a new block when its last one is full;
4. request C arrives;
5. B forks into B2 (a second sample of the same prompt): every block is shared, nothing copied;
6. B2 writes into the shared last block: copy-on-write gives it a private copy;
7. B writes its own token: the block is now its alone, no copy;
8. A finishes: its blocks return to the free list, the full ones still cached;
9. A's user asks a follow-up: the new request D finds A's old blocks in the prefix cache and takes
   them back from the free list;
10. B and B2 finish.

:func:`figure` draws one event: each physical block is a cell of ``block_size`` slots, filled
slots in the colour of the sequence(s) that own the block (a shared block is striped with every
owner's colour, its reference count written in the cell), free blocks white, free blocks whose
contents are still in the prefix cache hatched grey. Each sequence's block table is a row of
boxes on the left, one per logical block, with an arrow to the physical block it names.

:func:`explore` puts a slider over the events (``llmu.viz.interactive``); without a widget
frontend, :func:`figures` returns the list of figures.
"""

from __future__ import annotations

import textwrap
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from llmu.paged.block_manager import BlockManager

__all__ = ["Event", "scenario", "figure", "figures", "explore", "SEQUENCE_COLORS"]

#: Colours of the sequences, in order of arrival (the Okabe-Ito colours of ``llmu.viz.COLORS``).
SEQUENCE_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442"]


@dataclass
class Event:
    """The block manager after one event of the scenario."""

    caption: str
    snapshot: dict  # BlockManager.snapshot()
    lengths: dict[Hashable, int]  # positions each sequence holds
    tokens: dict[Hashable, list[int]] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) of this event
    num_blocks: int = 0
    colors: dict[Hashable, str] = field(default_factory=dict)  # sequence -> colour, stable over the story


class _Story:
    """The scenario's state: a block manager, and each sequence's tokens (their keys/values exist)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.tokens: dict[str, list[int]] = {}
        self.colors: dict[str, str] = {}
        self.events: list[Event] = []

    def record(self, caption: str, copies=()) -> None:
        self.events.append(Event(caption, self.bm.snapshot(), {s: len(t) for s, t in self.tokens.items()},
                                 {s: list(t) for s, t in self.tokens.items()}, list(copies), self.bm.num_blocks,
                                 dict(self.colors)))

    def _color(self, seq: str) -> None:
        if seq not in self.colors:
            self.colors[seq] = SEQUENCE_COLORS[len(self.colors) % len(SEQUENCE_COLORS)]

    def arrive(self, seq: str, prompt: list[int]) -> int:
        """Allocate a table for ``prompt``, compute what the prefix cache did not have, register it."""
        self._color(seq)
        cached = self.bm.allocate(seq, prompt)
        copies = self.bm.prepare_write(seq, cached, len(prompt))
        self.tokens[seq] = list(prompt)
        self.bm.commit(seq, prompt, len(prompt))
        assert not copies  # a fresh table has no shared block past its cached prefix
        return cached

    def grow(self, seq: str, token: int) -> list[tuple[int, int]]:
        """Write one more token of ``seq`` (copy-on-write first if its block is shared)."""
        n = len(self.tokens[seq])
        copies = self.bm.prepare_write(seq, n, n + 1)
        self.tokens[seq].append(token)
        self.bm.commit(seq, self.tokens[seq], n + 1)
        return copies

    def fork(self, parent: str, child: str) -> None:
        self._color(child)
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def finish(self, seq: str) -> None:
        self.bm.free(seq)
        del self.tokens[seq]


def scenario(block_size: int = 4, num_blocks: int = 16) -> list[Event]:
    """The story of the module docstring on a pool of ``num_blocks`` blocks of ``block_size``.

    Token ids are small integers: the system prompt is ``1 .. 2 * block_size`` (two full blocks).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 12:
        raise ValueError(f"num_blocks must be an int >= 12 (the story needs that many), got {num_blocks!r}")
    bs = block_size
    s = _Story(num_blocks, bs)
    system = list(range(1, 2 * bs + 1))
    s.record(f"An empty pool: {num_blocks} free blocks of {bs} positions. No sequence holds a block yet.")

    question_a = list(range(101, 101 + bs - 1))  # A's prompt ends one slot short of a full block
    s.arrive("A", system + question_a)
    n = len(system) + len(question_a)
    s.record(f"Request A arrives: a {len(system)}-token system prompt and a {len(question_a)}-token question, "
             f"{n} positions in {s.bm.blocks_for(n)} blocks, the last one with an empty slot. Its full blocks "
             "are registered in the prefix cache.")

    cached = s.arrive("B", system + list(range(201, 201 + bs + 1)))
    s.record(f"Request B starts with the same system prompt. The prefix cache already holds its first "
             f"{cached} positions: B's table points at A's blocks (reference count 2) and only B's own "
             f"question ({bs + 1} tokens) is computed and stored.")

    s.grow("A", 101 + bs - 1)
    s.record("A generates a token; it fills the empty slot of its last block. That block is now full, "
             "so it is registered in the prefix cache too.")

    s.grow("A", 101 + bs)
    s.record("A's next token does not fit: it takes one new block from the free list. A sequence grows "
             f"one block at a time, so at most {bs - 1} of its positions are ever allocated and empty.")

    s.arrive("C", list(range(301, 301 + bs + 2)))
    s.record(f"Request C arrives with an unrelated {bs + 2}-token prompt: nothing to share, two fresh blocks.")

    s.fork("B", "B2")
    s.record("B forks into B2 to sample a second answer to the same prompt. B2's table is a copy of B's "
             "table: every block is shared (reference counts go up), no key or value is copied.")

    copies = s.grow("B2", 211)
    (src, dst), = copies
    s.record(f"B2 writes its first token. Its last block is shared with B, so copy-on-write gives B2 a "
             f"private copy first: block {src} is copied to block {dst}, and B2's table now points at {dst}.",
             copies)

    copies = s.grow("B", 221)
    s.record("B writes its own token into its last block: nobody else uses that block any more "
             "(reference count 1), so B writes in place, no copy." if not copies else
             "B writes its own token (copy-on-write again).", copies)

    conversation = list(s.tokens["A"])
    s.finish("A")
    s.record("A finishes. Blocks still used by B and B2 (the system prompt) stay; A's other blocks go back "
             "to the free list. The full ones keep their contents and their place in the prefix cache "
             "(hatched) until the block is handed out again.")

    follow_up = conversation + list(range(401, 401 + bs - 1))
    cached = s.arrive("D", follow_up)
    s.record(f"A's user asks a follow-up: request D's prompt is A's conversation plus a new question. The "
             f"prefix cache holds its first {cached} positions, including a block A left on the free list: "
             "it is taken back from the free list, contents intact.")

    s.finish("B")
    s.finish("B2")
    s.record("B and B2 finish. Their private blocks return to the free list; the system prompt's blocks "
             "stay in use by D. Every block is accounted for: in a table, or free.")
    s.bm.check_invariants()
    return s.events


# ----------------------------------------------------------------------------------------------
# The figure
# ----------------------------------------------------------------------------------------------


def _block_fill(event: Event) -> dict[int, int]:
    """Positions filled in each physical block that some sequence holds."""
    bs = event.snapshot["block_size"]
    fill: dict[int, int] = {}
    for seq, table in event.snapshot["tables"].items():
        n = event.lengths.get(seq, 0)
        for i, b in enumerate(table):
            fill[b] = max(fill.get(b, 0), max(0, min(bs, n - i * bs)))
    return fill


def figure(event: Event, *, columns: int = 8, title: str | None = None):
    """A plotly figure of one :class:`Event` (see the module docstring)."""
    import plotly.graph_objects as go

    from llmu import viz

    snap = event.snapshot
    bs = snap["block_size"]
    tables = snap["tables"]
    refs = snap["ref_counts"]
    cached = set(snap["cached"])
    free = set(snap["free"])
    num_blocks = len(refs)
    fill = _block_fill(event)
    owners: dict[int, list] = {}
    for seq, table in tables.items():
        for b in table:
            owners.setdefault(b, []).append(seq)
    copied_to = {d for _, d in event.copies}

    shapes, annotations = [], []
    hatch_x, hatch_y = [], []  # cached free blocks: one hatched polygon each, separated by None
    hover_x, hover_y, hover_text = [], [], []
    max_table = max((len(t) for t in tables.values()), default=0)
    table_w = max(max_table, 4)
    x0 = table_w + 3.0  # where the pool starts
    cell_w, cell_h, gap = 1.0, 0.7, 0.25
    pool_pitch, table_pitch = cell_h + 0.5, cell_h + 0.25  # pool rows leave room for the block ids
    rows = -(-num_blocks // columns)

    def cell_xy(b):
        r, c = divmod(b, columns)
        return x0 + c * (cell_w + gap), -r * pool_pitch

    # -- the pool: one cell per physical block
    for b in range(num_blocks):
        x, y = cell_xy(b)
        seqs = owners.get(b, [])
        if seqs:
            filled = fill.get(b, 0)
            band = cell_h / len(seqs)
            for k, seq in enumerate(seqs):  # one band per owner: a shared block is striped
                shapes.append(dict(type="rect", x0=x, x1=x + cell_w * filled / bs, y0=y - (k + 1) * band,
                                   y1=y - k * band, fillcolor=event.colors.get(seq, "#888"), line_width=0,
                                   layer="below"))
        elif b in cached:
            hatch_x += [x, x + cell_w, x + cell_w, x, x, None]
            hatch_y += [y, y, y - cell_h, y - cell_h, y, None]
        for j in range(1, bs):  # slot boundaries
            shapes.append(dict(type="line", x0=x + j * cell_w / bs, x1=x + j * cell_w / bs, y0=y, y1=y - cell_h,
                               line=dict(color="#cccccc", width=0.5)))
        line = dict(color="#777777", width=1)
        if len(seqs) > 1:
            line = dict(color="#000000", width=3)
        if b in copied_to:
            line = dict(color="#000000", width=3, dash="dot")
        shapes.append(dict(type="rect", x0=x, x1=x + cell_w, y0=y - cell_h, y1=y, line=line))
        annotations.append(dict(x=x + cell_w / 2, y=y + 0.05, text=f"<b>{b}</b>", showarrow=False,
                                font=dict(size=11), yanchor="bottom"))
        inside = f"×{refs[b]}" if refs[b] > 1 else ("cached" if b in free and b in cached else "")
        if inside:
            annotations.append(dict(x=x + cell_w / 2, y=y - cell_h / 2, text=f"<b>{inside}</b>", showarrow=False,
                                    font=dict(size=11 if refs[b] > 1 else 9, color="#000000"),
                                    bgcolor="rgba(255,255,255,0.75)"))
        if seqs:
            state = f"held by {', '.join(map(str, seqs))}, {fill.get(b, 0)}/{bs} positions filled"
        else:
            state = "free" + (", its contents still in the prefix cache" if b in cached else "")
        hover_x.append(x + cell_w / 2)
        hover_y.append(y - cell_h / 2)
        hover_text.append(f"block {b}: reference count {refs[b]}; {state}")
    if event.copies:
        for s_, d_ in event.copies:
            (sx, sy), (dx, dy) = cell_xy(s_), cell_xy(d_)
            annotations.append(dict(x=dx + cell_w / 2, y=dy - cell_h, ax=sx + cell_w / 2, ay=sy - cell_h,
                                    xref="x", yref="y", axref="x", ayref="y", showarrow=True, arrowhead=3,
                                    arrowcolor="#000000", arrowwidth=2, text=""))
    annotations.append(dict(x=x0, y=0.75, text="<b>physical blocks</b> (the pool)", showarrow=False,
                            xanchor="left", font=dict(size=12)))

    # -- the block tables: one row per sequence
    annotations.append(dict(x=0, y=0.75, text="<b>block tables</b>", showarrow=False, xanchor="left",
                            font=dict(size=12)))
    for r, (seq, table) in enumerate(tables.items()):
        y = -r * table_pitch
        color = event.colors.get(seq, "#888")
        annotations.append(dict(x=-0.2, y=y - cell_h / 2, text=f"<b>{seq}</b> ({event.lengths.get(seq, 0)})",
                                showarrow=False, xanchor="right", font=dict(color=color, size=12)))
        for i, b in enumerate(table):
            bx = i * 0.8
            shapes.append(dict(type="rect", x0=bx, x1=bx + 0.7, y0=y - cell_h, y1=y, fillcolor=color,
                               opacity=0.85, line=dict(color="#333", width=1)))
            annotations.append(dict(x=bx + 0.35, y=y - cell_h / 2, text=f"<b>{b}</b>", showarrow=False,
                                    font=dict(color="white", size=11)))
            px, py = cell_xy(b)
            annotations.append(dict(x=px, y=py - cell_h / 2, ax=bx + 0.7, ay=y - cell_h / 2, xref="x", yref="y",
                                    axref="x", ayref="y", showarrow=True, arrowhead=2, arrowsize=0.8,
                                    arrowwidth=1, arrowcolor=color, opacity=0.45, text=""))

    # -- a footer: the free list and the prefix cache
    bottom = min(-rows * pool_pitch, -len(tables) * table_pitch) - 0.1
    free_list = snap["free"]
    shown = ", ".join(map(str, free_list[:12])) + (" …" if len(free_list) > 12 else "")
    footer = [f"free list ({len(free_list)}, next out first): {shown or '(empty)'}",
              f"prefix cache: blocks {', '.join(map(str, sorted(cached))) or '(none)'}"]
    if event.copies:
        footer.append("copy-on-write: " + ", ".join(f"{a} → {b}" for a, b in event.copies))
    annotations.append(dict(x=0, y=bottom, xanchor="left", yanchor="top", showarrow=False, align="left",
                            text="<br>".join(footer), font=dict(size=11)))
    width_units = x0 + columns * (cell_w + gap)
    data = [go.Scatter(x=hover_x, y=hover_y, mode="markers", marker=dict(opacity=0), hovertext=hover_text,
                       hoverinfo="text", showlegend=False)]
    if hatch_x:
        data.append(go.Scatter(x=hatch_x, y=hatch_y, fill="toself", mode="lines", line=dict(width=0),
                               fillcolor="#dddddd", fillpattern=dict(shape="/", fgcolor="#999999", size=6),
                               hoverinfo="skip", showlegend=False))
    fig = go.Figure(data=data, layout=dict(shapes=shapes, annotations=annotations, showlegend=False,
                                           hovermode="closest"))
    fig.update_xaxes(visible=False, range=[-1.6, width_units + 0.2])
    fig.update_yaxes(visible=False, range=[bottom - 0.9, 1.1])
    caption = "<br>".join(textwrap.wrap(event.caption, 110))
    fig = viz.style(fig, title if title is not None else caption, height=230 + 55 * max(rows, len(tables)))
    fig.update_layout(title=dict(font=dict(size=12)), margin=dict(l=20, r=20, t=30 + 16 * caption.count("<br>") + 16,
                                                                   b=10))
    return fig


def figures(events: Sequence[Event] | None = None, **kwargs) -> list:
    """One figure per event (of :func:`scenario` by default): what a page without widgets shows."""
    events = scenario() if events is None else events
    return [figure(e, **kwargs) for e in events]


def explore(events: Sequence[Event] | None = None, **kwargs):
    """A slider over the events: ``llmu.viz.interactive`` around :func:`figure`."""
    from ipywidgets import IntSlider

    from llmu import viz

    events = scenario() if events is None else list(events)
    if not events:
        raise ValueError("events is empty: nothing to show")
    slider = IntSlider(value=0, min=0, max=len(events) - 1, step=1, description="event",
                       continuous_update=False)
    return viz.interactive(lambda event: figure(events[event], **kwargs), event=slider)
