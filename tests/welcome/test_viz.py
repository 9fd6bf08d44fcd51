"""The program-map picture of module 00 counts programs and masked lanes correctly."""

import pytest

from llmu.welcome.viz import program_map, program_map_figure


@pytest.mark.parametrize("n,block,programs,masked", [(1, 8, 1, 7), (16, 8, 2, 0), (17, 8, 3, 7), (100, 32, 4, 28)])
def test_program_map_counts(n, block, programs, masked):
    cells = program_map(n, block)
    assert len({p for p, _, _ in cells}) == programs
    assert sum(not a for _, _, a in cells) == masked
    covered = sorted(p * block + lane for p, lane, a in cells if a)
    assert covered == list(range(n))  # every element exactly once


def test_program_map_figure_title_and_bad_input():
    fig = program_map_figure(17, 8)
    assert "3 program(s)" in fig.layout.title.text and "7 masked" in fig.layout.title.text
    with pytest.raises(ValueError, match="must be positive"):
        program_map(0, 8)
