"""cache.recurrent: the states a pass keeps for a rollback are views of the buffers the pass wrote."""

from __future__ import annotations

import torch

from mtpserve.cache import KeptSteps, RecurrentState


def test_kept_steps_read_the_pass_buffers_step_by_step():
    conv, ssm = torch.randn(3, 8, 3), torch.randn(3, 2, 4, 4)
    kept = KeptSteps(conv, ssm)
    assert len(kept) == 3
    state = RecurrentState(torch.zeros(8, 3), torch.zeros(2, 4, 4))
    state.restore(kept[1])
    assert torch.equal(state.conv, conv[1]) and torch.equal(state.ssm, ssm[1])
    assert kept[-1].ssm.data_ptr() == ssm[2].data_ptr()  # a view, not a copy
    assert [torch.equal(s.conv, conv[t]) for t, s in zip((0, 2), kept[::2])] == [True, True]
