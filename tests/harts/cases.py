"""Forest cases shared by the harts tests (token ids < 61)."""

import pytest

CASES = [
    pytest.param([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [5, 6, 7, 13]], id="grpo-fork"),
    pytest.param([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 8, 10, 11], [1, 2, 12]],
                 id="nested-forks"),
    pytest.param([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 9], [3, 4, 5, 6]], id="duplicates"),
    pytest.param([[7, 8, 9], [7, 8, 9, 10, 11], [7], [7, 8]], id="prefix-of-another"),
    pytest.param([[2, 3, 4], [9, 3, 4, 5], [4, 4, 4, 4], [2, 5]], id="fork-at-0"),
    pytest.param([[11, 12, 13], [14, 15], [16, 17, 18, 19], [20]], id="no-sharing"),
]
