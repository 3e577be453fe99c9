import pytest
import torch

from st_weince.utils.hotpath import DeferredChecks, count_host_syncs


def test_deferred_checks_read_once_and_name_the_failure():
    checks = DeferredChecks()
    checks.require(torch.tensor(True), "first")
    checks.require(torch.tensor([1.0, 2.0]) > 0, "second")
    with count_host_syncs() as syncs:
        checks.raise_if_failed()
    assert syncs.total == 1
    checks.require(torch.tensor([1.0, -1.0]) > 0, "x must be positive")
    with pytest.raises(ValueError, match="x must be positive"):
        checks.raise_if_failed()


def test_no_checks_no_sync():
    with count_host_syncs() as syncs:
        DeferredChecks().raise_if_failed()
    assert syncs.total == 0


def test_sync_counter_sees_forward_and_backward_syncs():
    x = torch.randn(8, requires_grad=True)
    with count_host_syncs() as syncs:
        y = x[x > 0].sum() + float(x.sum())  # boolean-mask index + item
        y.backward()
    assert syncs.by_op["index(bool mask)"] == 1
    assert syncs.total >= 2
    with count_host_syncs() as syncs:
        (x.exp() * 2).sum().backward()
    assert syncs.total == 0
