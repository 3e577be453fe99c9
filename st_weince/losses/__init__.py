"""sentence-transformers loss classes: thin adapters over :mod:`st_weince.functional`, each with one frozen options
object (its defaults and checks)."""

from st_weince.losses.cached_rb_sigmoid import CachedRBSigmoidLoss
from st_weince.losses.cached_weince import CachedWEINCELoss
from st_weince.losses.rb_sigmoid import RBSigmoidLoss, RBSigmoidOptions
from st_weince.losses.weince import WEINCELoss, WEINCELossOptions

__all__ = [
    "CachedRBSigmoidLoss",
    "CachedWEINCELoss",
    "RBSigmoidLoss",
    "RBSigmoidOptions",
    "WEINCELoss",
    "WEINCELossOptions",
]
