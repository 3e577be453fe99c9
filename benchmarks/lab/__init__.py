"""The SimCLR and SimCSE studies' shared code. The SimCLR apparatus (data, augmentations, models, setups, training
step, probes) is the recipe's, ``recipes/simclr_tools``: put on ``sys.path`` here, so the studies import it by its
plain name as recipes/simclr.py does, one home for both."""

import sys
from pathlib import Path

_RECIPES = str(Path(__file__).resolve().parents[2] / "recipes")
if _RECIPES not in sys.path:
    sys.path.append(_RECIPES)
