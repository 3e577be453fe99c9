"""torch._dynamo.explain over both losses' training path (the released composite included): one graph, no graph
break, so torch.compile traces the whole loss and no data-dependent Python branch or host read hides in it."""

from __future__ import annotations

import pytest
import torch

from st_weince.functional import TopM
from st_weince.losses import RBSigmoidLoss, WEINCELoss

LOSSES = {
    "weince": lambda: WEINCELoss(None, check_inputs=False),
    "weince-composite": lambda: WEINCELoss(
        None, check_inputs=False, top_m=TopM(m=8, shortfall_weight=0.5, infonce_weight=0.5)
    ),
    "rb-sigmoid": lambda: RBSigmoidLoss(None, check_inputs=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_one_graph_without_breaks(name: str) -> None:
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    embeddings = [torch.randn(48, 16, generator=generator, requires_grad=True) for _ in range(2)]
    loss_fn = LOSSES[name]()
    explanation = torch._dynamo.explain(loss_fn.compute_loss_from_embeddings)(embeddings)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
