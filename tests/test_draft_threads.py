"""The draft service caps its CPU threads so it does not compete with the target for the cores."""

from __future__ import annotations

import pytest
import torch

from draft_service.main import limit_torch_threads
from tandem.config import DraftSettings


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_default_is_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_TORCH_THREADS", raising=False)
    assert DraftSettings().torch_threads == 1
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "0")
    assert DraftSettings().torch_threads == 0
    with pytest.raises(ValueError, match="torch_threads"):
        DraftSettings(torch_threads=-1)


def test_limit_sets_the_intra_op_threads(restore_threads: int) -> None:
    limit_torch_threads(1)
    assert torch.get_num_threads() == 1
    limit_torch_threads(0)  # 0 leaves whatever is set
    assert torch.get_num_threads() == 1
    limit_torch_threads(2)
    assert torch.get_num_threads() == 2
