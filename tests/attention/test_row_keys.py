"""`RowKeys.by_real_index`: where a sliding-window layer's keys sit for batch-invariant attention."""

import torch

from hf_paged_cache.attention.reads import QueryRows, RowKeys


def row_keys(counts: list[int], before: list[int]) -> RowKeys:
    slots = [torch.arange(100, 100 + count) for count in counts]
    positions = [torch.arange(count) for count in counts]
    return RowKeys(slots=slots, positions=positions, spans=[(0, count - 1) for count in counts], before=before)


def test_each_rows_keys_start_at_their_real_index_within_a_tile():
    keys = row_keys([3, 2], before=[0, 70])  # row 1's first key read is its 71st real token: column 6 of a tile
    index = keys.by_real_index(8, width=3, new=None)
    assert index.tolist() == [
        [1, 2, 3, 0, 0, 0, 0, 0],  # stored keys 1.. from column 0, nulls after
        [0, 0, 0, 0, 0, 0, 1, 2],  # 70 % 8 = 6 null columns first
    ]
    assert keys.by_real_index(8, width=3, new=None) is index  # made once per forward


def test_a_longer_forwards_real_new_tokens_follow_the_stored_keys():
    keys = row_keys([2, 1], before=[5, 0])
    new = QueryRows(positions=torch.arange(10, 13), picked=[None, torch.tensor([2])], spans=[(10, 12), (12, 12)])
    index = keys.by_real_index(4, width=2, new=new)
    # sources: 0 null, 1-2 the stored columns, 3-5 the new tokens; row 1's first two new tokens are padding
    assert index.tolist() == [
        [0, 1, 2, 3, 4, 5, 0, 0],  # 5 % 4 = 1 null, 2 stored, 3 new: 6 columns, rounded up to 8
        [1, 5, 0, 0, 0, 0, 0, 0],
    ]
