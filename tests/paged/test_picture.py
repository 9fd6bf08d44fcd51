"""llmu.paged.picture: the scripted scenario drives the real BlockManager through the story its
docstring tells (checked event by event on its snapshots), and every event draws a figure that
shows exactly the manager's state. No tolerances: all of it is bookkeeping.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

from llmu.paged import picture


def arrows(fig):
    return [a for a in fig.layout.annotations if a.showarrow and a.axref == "x"]


def hatched(fig):
    """The hatched polygons (cached free blocks): one trace, polygons separated by None."""
    traces = [t for t in fig.data if t.fillpattern is not None and t.fillpattern.shape == "/"]
    return [x for t in traces for x in t.x if x is None]


def check_snapshot(e: picture.Event):
    snap, bs = e.snapshot, e.snapshot["block_size"]
    counts = [0] * e.num_blocks
    for seq, table in snap["tables"].items():
        assert len(table) == -(-e.lengths[seq] // bs), f"{seq}: table of {len(table)} for {e.lengths[seq]} positions"
        assert len(e.tokens[seq]) == e.lengths[seq]
        for b in table:
            counts[b] += 1
    assert snap["ref_counts"] == counts
    assert sorted(snap["free"]) == [b for b in range(e.num_blocks) if counts[b] == 0]
    assert set(e.lengths) == set(snap["tables"])


@pytest.mark.parametrize("block_size,num_blocks", [(4, 16), (2, 12), (8, 32), (16, 13)])
def test_scenario_tells_its_story(block_size, num_blocks):
    ev = picture.scenario(block_size=block_size, num_blocks=num_blocks)
    assert len(ev) == 12
    for e in ev:
        check_snapshot(e)
        assert e.caption and e.num_blocks == num_blocks
    t = [e.snapshot["tables"] for e in ev]
    refs = [e.snapshot["ref_counts"] for e in ev]
    assert t[0] == {}
    # 1. A: system prompt (2 blocks, registered) + a question one slot short of a block
    assert len(t[1]["A"]) == 3 and set(t[1]["A"][:2]) <= set(ev[1].snapshot["cached"])
    # 2. B shares A's system-prompt blocks through the prefix cache
    assert t[2]["B"][:2] == t[2]["A"][:2] and all(refs[2][b] == 2 for b in t[2]["A"][:2])
    assert not set(t[2]["B"][2:]) & set(t[2]["A"])
    # 3./4. A fills its last block (now cached), then takes exactly one new block
    assert t[3]["A"] == t[2]["A"] and t[2]["A"][2] in ev[3].snapshot["cached"]
    assert t[4]["A"][:3] == t[3]["A"] and len(t[4]["A"]) == 4
    # 6. the fork shares everything
    assert t[6]["B2"] == t[6]["B"] and all(refs[6][b] == refs[5][b] + 1 for b in t[6]["B"])
    # 7. copy-on-write: B2's last block becomes a private copy of B's
    (src, dst), = ev[7].copies
    assert src == t[6]["B"][-1] and t[7]["B2"][-1] == dst and t[7]["B"] == t[6]["B"] and refs[7][dst] == 1
    assert dst in ev[6].snapshot["free"]
    # 8. B writes in place
    assert ev[8].copies == [] and t[8]["B"] == t[7]["B"]
    # 9. A leaves: its private blocks are free, the full one stays cached
    assert "A" not in t[9]
    a_private = [b for b in t[8]["A"] if refs[8][b] == 1]
    assert set(a_private) <= set(ev[9].snapshot["free"])
    cached_free = set(ev[9].snapshot["free"]) & set(ev[9].snapshot["cached"])
    assert t[8]["A"][2] in cached_free
    # 10. D revives it from the free list
    assert t[10]["D"][:3] == t[8]["A"][:3] and t[8]["A"][2] not in ev[10].snapshot["free"]
    # 11. only C and D remain
    assert set(t[11]) == {"C", "D"}


def test_scenario_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        picture.scenario(block_size=1)
    with pytest.raises(ValueError, match="num_blocks"):
        picture.scenario(num_blocks=8)


@pytest.fixture(scope="module")
def events():
    return picture.scenario()


def test_figure_draws_the_state(events):
    for e in events:
        fig = picture.figure(e)
        assert isinstance(fig, go.Figure)
        tables = e.snapshot["tables"]
        assert len(arrows(fig)) == sum(len(t) for t in tables.values()) + len(e.copies)
        cached_free = set(e.snapshot["free"]) & set(e.snapshot["cached"])
        assert len(hatched(fig)) == len(cached_free)
        words = e.caption.split()[:4]
        assert " ".join(words) in fig.layout.title.text.replace("<br>", " ")
        texts = " ".join(a.text for a in fig.layout.annotations if a.text)
        for seq in tables:
            assert f"<b>{seq}</b>" in texts
        for r in e.snapshot["ref_counts"]:
            if r > 1:
                assert f"×{r}" in texts


def test_figures_without_widgets(events):
    figs = picture.figures(events, columns=4)
    assert len(figs) == len(events) and all(isinstance(f, go.Figure) for f in figs)
    assert len(picture.figures()) == len(events)


def test_explore_steps_through_the_events(events):
    w = picture.explore(events)
    assert isinstance(w, widgets.VBox)
    slider = w.controls["event"]
    assert (slider.min, slider.max) == (0, len(events) - 1)
    assert w.result.layout.title.text.startswith("An empty pool")
    slider.value = 7
    assert "copy-on-write" in w.result.layout.title.text and w.error is None
    with pytest.raises(ValueError, match="events is empty"):
        picture.explore([])
